-- ARGV[3] = a key prefix. Forgets every key that starts with it; returns how many.
local prefix, count = ARGV[3], 0
for _, key in ipairs(redis.call('HKEYS', map)) do
  if string.sub(key, 1, #prefix) == prefix and free_key(key) then
    count = count + 1
  end
end
return count
