-- ARGV[5..]: four per job: id, class, priority, due. Puts each job in its ready key and returns
-- the ids the per-user keys lack (those need add.lua, with their JobMeta).
local missing = {}
for i = 5, #ARGV, 4 do
  local id, class, prio, due = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  redis.call('ZADD', ready_key(class, prio), due, id)
  if redis.call('HEXISTS', p .. 'sched:job', id) == 0 then
    missing[#missing + 1] = id
  end
end
return missing
