-- PENDING -> READY: record where the KV lives; the READY lease (the record's lease_s) starts now.
-- ARGV[3] allowed sources, ARGV[4] location JSON.
local key, tid, now = KEYS[2], ARGV[2], ARGV[1]
local rec = redis.call('HMGET', key, 'state', 'lease_s')
local state = rec[1]
if not state then
  return {'missing'}
end
if not allowed(ARGV[3], state) then
  return {'illegal', state}
end
local deadline = deadline_after(now, rec[2])
redis.call('HSET', key, 'state', 'READY', 'location', ARGV[4], 'updated_at', now, 'deadline', deadline)
redis.call('ZADD', KEYS[1], deadline, tid)
count_move(state, 'READY')
left_pending(state, tid)
return reply(key, state)
