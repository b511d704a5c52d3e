-- Create a PENDING handoff with a fresh kv_key (INCR: unique, never a hash of the id).
-- Lua numbers are doubles: the counter stays below 2^53 (see memory.kv_key_seed) and is formatted with
-- '%.0f', never tostring, so every digit survives.
-- KEYS[3] kv_key counter. ARGV[3] counter seed, ARGV[4] prefill instance id, ARGV[5] request id ('' = none),
-- ARGV[6] PENDING deadline, ARGV[7] READY lease (s).
local key = KEYS[2]
local existing = redis.call('HGET', key, 'state')
if existing then
  return {'exists', existing}
end
redis.call('SET', KEYS[3], ARGV[3], 'NX')
local kv = string.format('%.0f', redis.call('INCR', KEYS[3]))
redis.call('HSET', key, 'transfer_id', ARGV[2], 'kv_key', kv, 'state', CFG.pending,
  'prefill_instance_id', ARGV[4], 'created_at', ARGV[1], 'updated_at', ARGV[1],
  'deadline', ARGV[6], 'lease_s', ARGV[7], 'claims', 0)
if ARGV[5] ~= '' then
  redis.call('HSET', key, 'request_id', ARGV[5])
end
redis.call('ZADD', KEYS[1], ARGV[6], ARGV[2])
count_move(nil, CFG.pending)
return {'ok', kv}
