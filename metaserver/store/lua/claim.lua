-- READY -> CLAIMED by one decode; exactly one concurrent claimer wins. The claimant may claim again
-- (idempotent retry) and renews its claim lease.
-- ARGV[3] allowed sources, ARGV[4] decode instance id, ARGV[5] claim lease (s).
local key, tid, now = KEYS[2], ARGV[2], ARGV[1]
local rec = redis.call('HMGET', key, 'state', 'decode_instance_id')
local state = rec[1]
if not state then
  return {'missing'}
end
local deadline = deadline_after(now, ARGV[5])
if state == 'CLAIMED' then
  if rec[2] == ARGV[4] then
    redis.call('HSET', key, 'updated_at', now, 'deadline', deadline)
    redis.call('ZADD', KEYS[1], deadline, tid)
    return reply(key, state)
  end
  return {'illegal', state, rec[2] or ''}
end
if not allowed(ARGV[3], state) then
  return {'illegal', state}
end
redis.call('HSET', key, 'state', 'CLAIMED', 'decode_instance_id', ARGV[4], 'updated_at', now, 'deadline', deadline)
redis.call('HINCRBY', key, 'claims', 1)
redis.call('ZADD', KEYS[1], deadline, tid)
count_move(state, 'CLAIMED')
return reply(key, state)
