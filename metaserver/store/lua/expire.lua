-- The sweeper's step: apply ledger.lapse to every handoff whose lease is due. Each record is re-checked
-- here (state and deadline), so several metaserver replicas may sweep at once: one of them moves it.
-- KEYS[1] deadlines zset only; ARGV[2] unused. ARGV[3] batch limit, ARGV[4] states that may expire
-- (",CLAIMED,PENDING,READY,"). Records are found by CFG.handoff_prefix .. transfer_id.
-- Reply: one {before, field, value, ...} per moved record.
local now = ARGV[1]
local max_claims = CFG.max_claims
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, tid in ipairs(due) do
  local key = CFG.handoff_prefix .. tid
  local rec = redis.call('HMGET', key, 'state', 'deadline', 'claims', 'lease_s')
  local state = rec[1]
  if not state or not rec[2] or not allowed(ARGV[4], state) then
    redis.call('ZREM', KEYS[1], tid)
  elseif tonumber(rec[2]) > tonumber(now) then
    redis.call('ZADD', KEYS[1], rec[2], tid)
  elseif state == 'CLAIMED' and tonumber(rec[3]) < max_claims then
    local deadline = deadline_after(now, rec[4])
    redis.call('HSET', key, 'state', 'READY', 'updated_at', now, 'deadline', deadline)
    redis.call('HDEL', key, 'decode_instance_id')
    redis.call('ZADD', KEYS[1], deadline, tid)
    count_move(state, 'READY')
    local r = redis.call('HGETALL', key)
    table.insert(r, 1, state)
    table.insert(out, r)
  else
    finish(key, tid, state, 'EXPIRED', state .. ' lease lapsed', now)
    local r = redis.call('HGETALL', key)
    table.insert(r, 1, state)
    table.insert(out, r)
  end
end
return out
