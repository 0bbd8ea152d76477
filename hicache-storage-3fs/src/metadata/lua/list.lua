-- ARGV[3] = a key prefix. Returns the keys that start with it.
local prefix, out = ARGV[3], {}
for _, key in ipairs(redis.call('HKEYS', map)) do
  if string.sub(key, 1, #prefix) == prefix then
    out[#out + 1] = key
  end
end
return out
