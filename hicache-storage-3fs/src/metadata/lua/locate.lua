-- ARGV[3..] = keys. Per key: 'index:generation', or '' when absent; found keys are touched.
local out = {}
for i = 3, #ARGV do
  local at = redis.call('HGET', map, ARGV[i])
  if at then
    touch(ARGV[i])
    out[#out + 1] = at
  else
    out[#out + 1] = ''
  end
end
return out
