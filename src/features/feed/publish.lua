-- Quiver feature publish: one entity write and its change record, atomically.
--
-- KEYS[1] entity key (g:{id}, or g:{key} for a string key)   KEYS[2] quiver:seq:g
-- KEYS[3] quiver:stream:g       KEYS[4] quiver:epoch:g        KEYS[5] quiver:keys:g
-- ARGV[1] 'put' or 'del'        ARGV[2] packed f32 vector (ignored for del)
-- ARGV[3] approximate stream MAXLEN
-- ARGV[4] the writer's bucket count, 0 for the plain layout
-- ARGV[5] the writer's key kind: 'u64' or 'string'
-- Bucketed layout only (every key then carries the bucket's hash tag {g:b}):
-- KEYS[6] quiver:buckets:{g:b}
-- Returns the change's sequence number; its stream entry id is "{seq}-0".
--
-- The form from before key kinds (4 keys and 3 arguments plain; 5 keys, KEYS[5] the buckets
-- key, and 4 arguments bucketed) is still taken, as a u64 writer.
--
-- The entity is written last, once its stream entry is in: Redis does not roll a script back
-- on error, and an entity change without its stream entry would be invisible to replicas.

local op = ARGV[1]
if op ~= 'put' and op ~= 'del' then
  return redis.error_reply('quiver: unknown publish op ' .. tostring(op))
end

local kind, kind_key, buckets_key, buckets
if #ARGV >= 5 then
  kind, kind_key = ARGV[5], KEYS[5]
  if ARGV[4] ~= '0' then
    buckets_key, buckets = KEYS[6], ARGV[4]
  end
else
  -- An older writer: u64 ids. Its kind key sits beside the counter, under the same hash tag.
  kind, kind_key = 'u64', 'quiver:keys:' .. string.sub(KEYS[2], 12)
  if #KEYS == 5 then
    buckets_key, buckets = KEYS[5], ARGV[4]
  end
end
if kind ~= 'u64' and kind ~= 'string' then
  return redis.error_reply('quiver: unknown key kind ' .. tostring(kind))
end

-- A bucket remembers the bucket count it was first written with: a writer that hashes ids
-- with another count would put entities where no replica looks for them.
if buckets_key then
  local stored = redis.call('GET', buckets_key)
  if not stored then
    redis.call('SET', buckets_key, buckets)
  elseif stored ~= buckets then
    return redis.error_reply('quiver: ' .. buckets_key .. ' says the group has ' .. stored ..
      ' buckets; this writer uses ' .. tostring(buckets))
  end
end

-- A group holds one key kind: `g:42` is id 42 to one writer and the string "42" to another.
-- A group written before kinds were recorded has a counter and no kind: it holds u64 ids.
local recorded = redis.call('GET', kind_key)
local stored_kind = recorded
if not recorded and redis.call('EXISTS', KEYS[2]) == 1 then
  stored_kind = 'u64'
end
if stored_kind and stored_kind ~= kind then
  return redis.error_reply('quiver: key kind ' .. stored_kind .. ' in ' .. kind_key .. ', this writer writes ' .. kind)
end
if not recorded then
  redis.call('SET', kind_key, kind)
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
