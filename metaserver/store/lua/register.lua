-- Register or update an instance. A live previous record keeps its CFG.kept fields (registry.reregister:
-- its start and its state, so a drain is sticky).
-- KEYS[1] instance hash, KEYS[2] instances zset (lease deadlines).
-- ARGV[1] now, ARGV[2] instance id, ARGV[3] registration JSON, ARGV[4] lease (s), ARGV[5] load JSON,
-- ARGV[6] lease deadline, ARGV[7] key TTL (ms), ARGV[8...] the new record's CFG.kept fields.
-- Reply: the CFG.kept fields as stored.
local kept = {}
for i = 1, #CFG.kept do
  kept[i] = ARGV[7 + i]
end
if instance_live(KEYS[1], ARGV[1]) then
  kept = redis.call('HMGET', KEYS[1], unpack(CFG.kept))
end
redis.call('HSET', KEYS[1], 'doc', ARGV[3], 'lease_s', ARGV[4], 'load', ARGV[5], 'last_heartbeat', ARGV[1])
for i, name in ipairs(CFG.kept) do
  redis.call('HSET', KEYS[1], name, kept[i])
end
redis.call('PEXPIRE', KEYS[1], ARGV[7])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[2])
return kept
