-- Prepended to every script when it is loaded (store/redis.py); not a script of its own.
-- Before it, store/redis.py puts one line `local CFG = {...}` with the store's constants, so they are
-- not sent with every call:
--   CFG.deadlines_suffix  CFG.handoff_suffix  CFG.events_suffix  CFG.state_counts_suffix
--               a shard's key names after its base (keys.py); CFG.left_pending  the pub/sub channel
--               (CFG.left_pending_suffix: a shard's own channel on a cluster)
--   CFG.buckets number of ledger shards (kv_key's shard bits; 1 on one Redis)
--   CFG.terminal_ttl_ms  CFG.events_maxlen  CFG.events_ttl_s  CFG.max_claims     retention (LedgerPolicy)
--   CFG.moves   ledger.MOVES, name -> {sources = {STATE = true}, to, lease, field, claimant,
--               below_max_claims, reason, reason_from, terminal, lapsed_sources = {STATE = true}}
--   CFG.kv_keys_per_ms  ledger.KV_KEYS_PER_MS (the kv_key clock floor, create.lua)
--   CFG.lapses  ledger.LAPSES (move names, tried in order)   CFG.claimed  ledger.CLAIMED_STATE
--   CFG.pending ledger.FIRST_STATE (a new record's state; leaving it wakes long-polls)
--   CFG.kept    registry.KEPT_ON_REREGISTER
--   CFG.instance_prefix  a registry record's key before its id (`{PREFIX}:i:`, keys.py; check_ready)
--
-- Layout shared by the handoff scripts:
--   KEYS[1] the shard's deadlines zset; KEYS[2] the handoff hash (absent in expire.lua)
--   ARGV[1] now (epoch s)  ARGV[2] transfer_id  ARGV[3...] the script's own arguments
-- Replies: {'ok', before_state, field, value, ...} | {'missing'} | {'illegal', state[, claimant]} | {'exists', state}
--          | {'not_its_prefill', rule, prefill_instance_id, registered_engine_id} (move.lua's READY: check_ready)
-- No rule is written here: `apply_move` interprets a row of ledger.MOVES, as ledger.apply does in Python.

-- The shard's key base ('{TAG}:'): every ledger key a script derives (records, event streams, state
-- counts) is in KEYS[1]'s hash slot, as Redis Cluster requires of a script.
local SHARD = ''
if KEYS[1] then
  SHARD = string.sub(KEYS[1], 1, #KEYS[1] - #CFG.deadlines_suffix)
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

-- Keep the shard's live-records-per-state hash in step: every script that changes a live
-- record's state calls this exactly once, in the same atomic step (from = nil on create, to = nil on a
-- terminal move), so any replica reads the same numbers with one HGETALL.
local function count_move(from, to)
  if from then
    redis.call('HINCRBY', SHARD .. CFG.state_counts_suffix, from, -1)
  end
  if to then
    redis.call('HINCRBY', SHARD .. CFG.state_counts_suffix, to, 1)
  end
end

-- Wake long-polls on this transfer id. On a cluster each shard has its own channel (SPUBLISH stays on
-- the shard's node; a plain PUBLISH would cross the cluster bus to every node): store/wakeups.py.
local function left_pending(before, tid)
  if before == CFG.pending then
    if CFG.buckets > 1 then
      redis.call('SPUBLISH', SHARD .. CFG.left_pending_suffix, tid)
    else
      redis.call('PUBLISH', CFG.left_pending, tid)
    end
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
  local stream = SHARD .. CFG.events_suffix .. rec[1]
  redis.call('XADD', stream, 'MAXLEN', '~', CFG.events_maxlen, '*',
    'transfer_id', tid, 'kv_key', rec[2], 'state', to, 'reason', reason or '', 'at', now)
  redis.call('EXPIRE', stream, CFG.events_ttl_s)
  count_move(before, nil)
  left_pending(before, tid)
end

-- The fields `apply_move` reads, in this order (HMGET key unpack(RECORD_FIELDS)).
local RECORD_FIELDS = {'state', 'decode_instance_id', 'lease_s', 'claims', 'deadline'}

local function applies(m, rec)
  return m.sources[rec[1]] and not (m.below_max_claims and tonumber(rec[4]) >= CFG.max_claims)
end

-- Interpret one row of ledger.MOVES on the record at `key` (`rec` = its RECORD_FIELDS); the twin of
-- ledger.apply. `caller` and `value` are '' when absent, `lease` the caller's lease. nil when the move
-- happened, else the {'illegal', ...} reply.
local function apply_move(m, key, tid, now, rec, caller, value, lease)
  local state, holder = rec[1], rec[2]
  if state == CFG.claimed then
    if m.claimant == 'take' then
      if holder == caller then
        local deadline = deadline_after(now, lease)
        redis.call('HSET', key, 'updated_at', now, 'deadline', deadline)
        redis.call('ZADD', KEYS[1], deadline, tid)
        return nil
      end
      return {'illegal', state, holder or ''}
    elseif m.claimant == 'check' and caller ~= '' and holder ~= caller then
      return {'illegal', state, holder or ''}
    end
  end
  if m.lapsed_sources[state] then
    -- the late DONE: only the last claimant (kept when its claim lapsed), naming itself
    if caller == '' or holder ~= caller then
      return {'illegal', state}
    end
  elseif not applies(m, rec) then
    return {'illegal', state}
  end
  -- where `reason` comes from is decided in ledger.Move.reason_from, not here
  local reason = nil
  if m.reason_from == 'fixed' then
    reason = string.format(m.reason, state)
  elseif m.reason_from == 'value' then
    reason = value
  end
  if m.terminal then
    finish(key, tid, state, m.to, reason, now)
    return nil
  end
  local deadline = deadline_after(now, m.lease == 'record' and rec[3] or lease)
  local fields = {'state', m.to, 'updated_at', now, 'deadline', deadline}
  if m.field and m.field ~= 'reason' then
    table.insert(fields, m.field)
    table.insert(fields, value)
  end
  if reason then
    table.insert(fields, 'reason')
    table.insert(fields, reason)
  end
  if m.claimant == 'take' then
    table.insert(fields, 'decode_instance_id')
    table.insert(fields, caller)
  end
  redis.call('HSET', key, unpack(fields))
  if m.claimant == 'take' then
    redis.call('HINCRBY', key, 'claims', 1)
  end
  redis.call('ZADD', KEYS[1], deadline, tid)
  count_move(state, m.to)
  left_pending(state, tid)
  return nil
end

-- The Lua side of registry.is_live: an instance counts until its heartbeat lease lapses.
local function instance_live(key, now)
  local rec = redis.call('HMGET', key, 'last_heartbeat', 'lease_s')
  return rec[1] and tonumber(rec[1]) + tonumber(rec[2]) >= tonumber(now)
end

-- The twin of ledger.check_ready (the rule is written there; same order, same outcomes): a READY only by
-- the handoff's own prefill. `engine` the caller's engine token's instance ('' = full access);
-- `has_engine_id` '1' when the location states `engine_id`. nil, or the {'not_its_prefill', ...} reply.
-- One shard only (CFG.buckets == 1): the prefill's registry hash is read in this atomic step without
-- being in KEYS, which holds because it shares the single ledger shard's hash tag `{PREFIX}` (keys.py).
-- With shards (a Cluster) it is in another slot, so store/redis.py checks with reads and never sends
-- these arguments.
local function check_ready(key, now, engine, has_engine_id, engine_id)
  local prefill = redis.call('HGET', key, 'prefill_instance_id')
  if engine ~= '' and engine ~= prefill then
    return {'not_its_prefill', 'engine', prefill, ''}
  end
  if has_engine_id == '1' then
    local ikey = CFG.instance_prefix .. prefill
    if instance_live(ikey, now) then
      -- the registered engine_id is in the record's JSON document (store/redis.py `register`)
      local registered = cjson.decode(redis.call('HGET', ikey, 'doc'))['engine_id']
      if type(registered) == 'string' and registered ~= engine_id then
        return {'not_its_prefill', 'engine_id', prefill, registered}
      end
    end
  end
  return nil
end
