-- Quiver feature publish: one entity write and its change record, atomically.
--
-- KEYS[1] entity key (g:{id})   KEYS[2] quiver:seq:g
-- KEYS[3] quiver:stream:g       KEYS[4] quiver:epoch:g
-- ARGV[1] 'put' or 'del'        ARGV[2] packed f32 vector (ignored for del)
-- ARGV[3] approximate stream MAXLEN
-- Bucketed layout only (every key then carries the bucket's hash tag {g:b}):
-- KEYS[5] quiver:buckets:{g:b}  ARGV[4] the writer's bucket count
-- Returns the change's sequence number; its stream entry id is "{seq}-0".
--
-- The entity is written last, once its stream entry is in: Redis does not roll a script back
-- on error, and an entity change without its stream entry would be invisible to replicas.

local op = ARGV[1]
if op ~= 'put' and op ~= 'del' then
  return redis.error_reply('quiver: unknown publish op ' .. tostring(op))
end

-- A bucket remembers the bucket count it was first written with: a writer that hashes ids
-- with another count would put entities where no replica looks for them.
if #KEYS == 5 then
  local stored = redis.call('GET', KEYS[5])
  if not stored then
    redis.call('SET', KEYS[5], ARGV[4])
  elseif stored ~= ARGV[4] then
    return redis.error_reply('quiver: ' .. KEYS[5] .. ' says the group has ' .. stored ..
      ' buckets; this writer uses ' .. tostring(ARGV[4]))
  end
end

local now = redis.call('TIME')
-- The epoch names this keyspace's history; a replica that sees it change knows Redis lost
-- (or was wiped of) the sequence it was following and must rebuild.
redis.call('SET', KEYS[4], now[1] .. string.format('%06d', tonumber(now[2])), 'NX')

local seq = redis.call('INCR', KEYS[2])
local id = string.format('%d-0', seq)
local ms = now[1] .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))

local added
if op == 'put' then
  added = redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], id, 'k', KEYS[1], 'v', ARGV[2], 't', ms)
else
  added = redis.pcall('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], id, 'k', KEYS[1], 'd', '1', 't', ms)
end
if type(added) == 'table' and added.err then
  -- Typically the stream is ahead of the counter (the seq key was deleted or reset): undo the
  -- increment so the counter is where it was, and say what is wrong.
  redis.call('DECR', KEYS[2])
  return redis.error_reply('quiver: cannot append ' .. id .. ' to ' .. KEYS[3] .. ' (is ' .. KEYS[2] ..
    ' behind the stream?): ' .. added.err)
end

if op == 'put' then
  redis.call('SET', KEYS[1], ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return seq
