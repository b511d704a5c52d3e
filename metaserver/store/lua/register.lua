-- Register or update an instance. A live previous record keeps registered_at and state (a drain is sticky).
-- KEYS[1] instance hash, KEYS[2] instances zset (lease deadlines).
-- ARGV[1] now, ARGV[2] instance id, ARGV[3] registration JSON, ARGV[4] lease (s), ARGV[5] load JSON,
-- ARGV[6] lease deadline, ARGV[7] key TTL (ms). Reply: {registered_at, state}.
local old = redis.call('HMGET', KEYS[1], 'last_heartbeat', 'lease_s', 'registered_at', 'state')
local registered_at, state = ARGV[1], 'ready'
if old[1] and tonumber(old[1]) + tonumber(old[2]) >= tonumber(ARGV[1]) then
  registered_at, state = old[3], old[4]
end
redis.call('HSET', KEYS[1], 'doc', ARGV[3], 'lease_s', ARGV[4], 'load', ARGV[5],
  'last_heartbeat', ARGV[1], 'registered_at', registered_at, 'state', state)
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[2])
return {registered_at, state}
