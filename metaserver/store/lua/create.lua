-- Create a PENDING handoff with a fresh kv_key (unique, never a hash of the id).
-- kv_key = counter * CFG.buckets + bucket: the shard bits keep the keys of different shards apart with
-- no cross-shard call. The shard's counter goes up by one per key and never falls below the clock floor,
-- ledger.kv_key_floor (why, and its bounds, are written there) of this server's TIME, divided among the
-- buckets; CFG.kv_keys_per_ms is ledger.KV_KEYS_PER_MS.
-- Lua numbers are doubles: every value stays below 2^53 and is formatted with '%.0f', never tostring,
-- so every digit survives.
-- KEYS[3] the shard's kv_key counter. ARGV[3] bucket (0..CFG.buckets-1), ARGV[4] prefill instance id,
-- ARGV[5] request id ('' = none), ARGV[6] PENDING deadline, ARGV[7] READY lease (s).
local key = KEYS[2]
local existing = redis.call('HGET', key, 'state')
if existing then
  return {'exists', existing}
end
local t = redis.call('TIME')
local floor = math.floor((tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) * CFG.kv_keys_per_ms / CFG.buckets)
local counter = tonumber(redis.call('GET', KEYS[3]) or '0') + 1
if counter < floor then
  counter = floor
end
redis.call('SET', KEYS[3], string.format('%.0f', counter))
local kv = string.format('%.0f', counter * CFG.buckets + tonumber(ARGV[3]))
redis.call('HSET', key, 'transfer_id', ARGV[2], 'kv_key', kv, 'state', CFG.pending,
  'prefill_instance_id', ARGV[4], 'created_at', ARGV[1], 'updated_at', ARGV[1],
  'deadline', ARGV[6], 'lease_s', ARGV[7], 'claims', 0)
if ARGV[5] ~= '' then
  redis.call('HSET', key, 'request_id', ARGV[5])
end
redis.call('ZADD', KEYS[1], ARGV[6], ARGV[2])
count_move(nil, CFG.pending)
return {'ok', kv}
