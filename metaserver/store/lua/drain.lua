-- Mark a live instance DRAINING. nil when unknown or lapsed.
-- KEYS[1] instance hash. ARGV[1] now, ARGV[2] the draining state.
if not instance_live(KEYS[1], ARGV[1]) then
  return nil
end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
return redis.call('HGETALL', KEYS[1])
