-- ARGV[3] = n written; ARGV[4 .. 3 + 2n] = key, 'index:generation' pairs; the rest = released 'index:generation'.
local function ours(at)
  local index = page_of(at)
  if redis.call('HGET', resv, index) == string.sub(at, #index + 2) then
    redis.call('HDEL', resv, index)
    return index
  end
  return nil
end
local written = tonumber(ARGV[3])
for i = 0, written - 1 do
  local key, at = ARGV[4 + 2 * i], ARGV[5 + 2 * i]
  local index = ours(at)
  if index then
    if redis.call('HEXISTS', map, key) == 1 then
      redis.call('RPUSH', free, index)
    else
      redis.call('HSET', map, key, at)
      touch(key)
    end
  end
end
for i = 4 + 2 * written, #ARGV do
  local index = ours(ARGV[i])
  if index then
    redis.call('RPUSH', free, index)
  end
end
return 'ok'
