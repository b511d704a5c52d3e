-- CLAIMED -> DONE: the decode pulled the KV; the prefill hears it on its feed and frees the blocks.
-- ARGV[3] allowed sources, ARGV[4] decode instance id ('' = not named; else it must be the claimant).
local key, tid, now = KEYS[2], ARGV[2], ARGV[1]
local rec = redis.call('HMGET', key, 'state', 'decode_instance_id')
local state = rec[1]
if not state then
  return {'missing'}
end
if state == 'CLAIMED' and ARGV[4] ~= '' and rec[2] ~= ARGV[4] then
  return {'illegal', state, rec[2] or ''}
end
if not allowed(ARGV[3], state) then
  return {'illegal', state}
end
finish(key, tid, state, 'DONE', nil, now)
return reply(key, state)
