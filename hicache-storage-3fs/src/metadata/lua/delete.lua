-- ARGV[3..] = keys. Returns how many were stored.
local count = 0
for i = 3, #ARGV do
  if free_key(ARGV[i]) then
    count = count + 1
  end
end
return count
