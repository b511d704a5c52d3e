-- Prepended to every handoff script when it is loaded (store/redis.py); not a script of its own.
-- Before it, store/redis.py puts one line `local CFG = {...}` with the store's constants (key prefixes from
-- keys.py, TTLs, bounds), so they are not sent with every call:
--   CFG.events_prefix  CFG.handoff_prefix  CFG.left_pending  CFG.terminal_ttl_ms  CFG.events_maxlen
--   CFG.events_ttl_s  CFG.max_claims  CFG.state_counts
--
-- Layout shared by the handoff scripts:
--   KEYS[1] deadlines zset; KEYS[2] the handoff hash (absent in expire.lua)
--   ARGV[1] now (epoch s)  ARGV[2] transfer_id  ARGV[3...] the script's own arguments
-- Replies: {'ok', before_state, field, value, ...} | {'missing'} | {'illegal', state[, claimant]} | {'exists', state}
-- Allowed source states arrive as ",A,B," (from ledger.OPERATIONS), so the transition table lives only in ledger.py.

local function allowed(csv, state)
  return string.find(csv, ',' .. state .. ',', 1, true) ~= nil
end

local function deadline_after(now, lease)
  return string.format('%.6f', tonumber(now) + tonumber(lease))
end

local function reply(key, before)
  local fields = redis.call('HGETALL', key)
  table.insert(fields, 1, before)
  table.insert(fields, 1, 'ok')
  return fields
end

-- Keep the live-records-per-state hash (CFG.state_counts) in step: every script that changes a live
-- record's state calls this exactly once, in the same atomic step (from = nil on create, to = nil on a
-- terminal move), so any replica reads the same numbers with one HGETALL.
local function count_move(from, to)
  if from then
    redis.call('HINCRBY', CFG.state_counts, from, -1)
  end
  if to then
    redis.call('HINCRBY', CFG.state_counts, to, 1)
  end
end

local function left_pending(before, tid)
  if before == 'PENDING' then
    redis.call('PUBLISH', CFG.left_pending, tid)
  end
end

-- A terminal move: no more lease, keep the record for a while, tell the prefill on its feed.
local function finish(key, tid, before, to, reason, now)
  if reason then
    redis.call('HSET', key, 'state', to, 'updated_at', now, 'reason', reason)
  else
    redis.call('HSET', key, 'state', to, 'updated_at', now)
  end
  redis.call('HDEL', key, 'deadline')
  redis.call('ZREM', KEYS[1], tid)
  redis.call('PEXPIRE', key, CFG.terminal_ttl_ms)
  local rec = redis.call('HMGET', key, 'prefill_instance_id', 'kv_key')
  local stream = CFG.events_prefix .. rec[1]
  redis.call('XADD', stream, 'MAXLEN', '~', CFG.events_maxlen, '*',
    'transfer_id', tid, 'kv_key', rec[2], 'state', to, 'reason', reason or '', 'at', now)
  redis.call('EXPIRE', stream, CFG.events_ttl_s)
  count_move(before, nil)
  left_pending(before, tid)
end
