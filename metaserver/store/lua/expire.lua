-- The sweeper's step: apply ledger.lapse to every handoff whose lease is due (the first move of
-- CFG.lapses that applies). Each record is re-checked here (state and deadline), so several metaserver
-- replicas may sweep at once: one of them moves it.
-- KEYS[1] the shard's deadlines zset only; ARGV[2] unused. ARGV[3] batch limit. Records are found by
-- SHARD .. CFG.handoff_suffix .. transfer_id (the same slot).
-- Reply: one {before, field, value, ...} per moved record.
local now = ARGV[1]
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, tid in ipairs(due) do
  local key = SHARD .. CFG.handoff_suffix .. tid
  local rec = redis.call('HMGET', key, unpack(RECORD_FIELDS))
  local deadline = rec[5]
  local move = nil
  if rec[1] and deadline then
    for _, name in ipairs(CFG.lapses) do
      if not move and applies(CFG.moves[name], rec) then
        move = CFG.moves[name]
      end
    end
  end
  if not move then
    redis.call('ZREM', KEYS[1], tid)
  elseif tonumber(deadline) > tonumber(now) then
    redis.call('ZADD', KEYS[1], deadline, tid)
  else
    apply_move(move, key, tid, now, rec, '', '', '')
    local r = redis.call('HGETALL', key)
    table.insert(r, 1, rec[1])
    table.insert(out, r)
  end
end
return out
