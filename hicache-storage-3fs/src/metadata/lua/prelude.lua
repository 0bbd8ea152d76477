-- Every script: KEYS = the space's info, free, generation, key, LRU and reservation keys; ARGV[1], ARGV[2] = the
-- space's page count and page size. The first script on a space records them; a script with others is refused.
local info, free, gen, map, lru, resv = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local num_pages, page_bytes = ARGV[1], ARGV[2]
local recorded = {redis.call('HGET', info, 'num_pages'), redis.call('HGET', info, 'page_bytes')}
if not recorded[1] then
  redis.call('HSET', info, 'num_pages', num_pages, 'page_bytes', page_bytes, 'fresh', 0, 'tick', 0)
elseif recorded[1] ~= num_pages or recorded[2] ~= page_bytes then
  return redis.error_reply('HICACHE_MISMATCH ' .. recorded[1] .. ' ' .. recorded[2])
end
local function touch(key)
  redis.call('ZADD', lru, redis.call('HINCRBY', info, 'tick', 1), key)
end
local function page_of(at)
  return string.match(at, '^(%d+):')
end
local function free_key(key)
  local at = redis.call('HGET', map, key)
  if not at then
    return false
  end
  redis.call('HDEL', map, key)
  redis.call('ZREM', lru, key)
  redis.call('RPUSH', free, page_of(at))
  return true
end
