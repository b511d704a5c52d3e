-- Renew an instance's lease (and its load). nil when unknown or already lapsed: it must re-register.
-- KEYS[1] instance hash, KEYS[2] instances zset. ARGV[1] now, ARGV[2] instance id, ARGV[3] load JSON ('' = keep),
-- ARGV[4] TTL grace (s).
if not instance_live(KEYS[1], ARGV[1]) then
  return nil
end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'last_heartbeat', ARGV[1], 'load', ARGV[3])
else
  redis.call('HSET', KEYS[1], 'last_heartbeat', ARGV[1])
end
local lease = tonumber(redis.call('HGET', KEYS[1], 'lease_s'))
redis.call('PEXPIRE', KEYS[1], math.ceil((lease + tonumber(ARGV[4])) * 1000))
redis.call('ZADD', KEYS[2], string.format('%.6f', tonumber(ARGV[1]) + lease), ARGV[2])
return redis.call('HGETALL', KEYS[1])
