-- ARGV[3..] = keys. Per key: 'present', 'index:generation' (a reserved page), or 'full'.
local out = {}
for i = 3, #ARGV do
  local key = ARGV[i]
  if redis.call('HEXISTS', map, key) == 1 then
    touch(key)
    out[#out + 1] = 'present'
  else
    local index = redis.call('LPOP', free)
    if not index then
      local fresh = tonumber(redis.call('HGET', info, 'fresh'))
      if fresh < tonumber(num_pages) then
        redis.call('HINCRBY', info, 'fresh', 1)
        index = string.format('%d', fresh)
      end
    end
    if not index then
      local victim = redis.call('ZRANGE', lru, 0, 0)[1]
      if victim then
        index = page_of(redis.call('HGET', map, victim))
        redis.call('ZREM', lru, victim)
        redis.call('HDEL', map, victim)
      end
    end
    if index then
      local generation = redis.call('HINCRBY', gen, index, 1)
      redis.call('HSET', resv, index, generation)
      out[#out + 1] = index .. ':' .. string.format('%d', generation)
    else
      out[#out + 1] = 'full'
    end
  end
end
return out
