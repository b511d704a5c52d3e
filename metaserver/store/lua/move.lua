-- One caller-driven move of ledger.MOVES (ready, claim, done, abort) on one handoff, atomically.
-- ARGV[3] move name, ARGV[4] caller: the decode instance id ('' = not named), ARGV[5] the value of the
-- move's field (location JSON, reason; '' = none), ARGV[6] the caller's lease (s; '' = none).
-- READY on one Redis also sends ARGV[7..9], the arguments of check_ready (_lib.lua), checked before the
-- state as ledger.check_ready is in the memory store.
local key, tid, now = KEYS[2], ARGV[2], ARGV[1]
local rec = redis.call('HMGET', key, unpack(RECORD_FIELDS))
if not rec[1] then
  return {'missing'}
end
if ARGV[7] then
  local wrong = check_ready(key, now, ARGV[7], ARGV[8], ARGV[9])
  if wrong then
    return wrong
  end
end
local refused = apply_move(CFG.moves[ARGV[3]], key, tid, now, rec, ARGV[4], ARGV[5], ARGV[6])
if refused then
  return refused
end
return reply(key, rec[1])
