-- Any live state -> ABORTED (client gone, failed pull); the prefill frees its blocks on the event.
-- ARGV[3] allowed sources, ARGV[4] reason.
local key, tid, now = KEYS[2], ARGV[2], ARGV[1]
local state = redis.call('HGET', key, 'state')
if not state then
  return {'missing'}
end
if not allowed(ARGV[3], state) then
  return {'illegal', state}
end
finish(key, tid, state, 'ABORTED', ARGV[4], now)
return reply(key, state)
