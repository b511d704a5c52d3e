-- Mark a live instance DRAINING. nil when unknown or lapsed.
-- KEYS[1] instance hash. ARGV[1] now.
local rec = redis.call('HMGET', KEYS[1], 'last_heartbeat', 'lease_s')
if not rec[1] or tonumber(rec[1]) + tonumber(rec[2]) < tonumber(ARGV[1]) then
  return nil
end
redis.call('HSET', KEYS[1], 'state', 'draining')
return redis.call('HGETALL', KEYS[1])
