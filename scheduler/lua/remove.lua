-- Drops jobs from every key of the index. ARGV[5..]: job ids. Returns how many were in it.
local removed = 0
for i = 5, #ARGV do
  local id = ARGV[i]
  local found = false
  local raw = redis.call('HGET', p .. 'sched:job', id)
  if raw then
    local m = cjson.decode(raw)
    local q = queue_name(m.model, m.job_class, m.priority)
    local qkey = p .. 'sched:q:' .. q .. ':' .. m.owner
    redis.call('ZREM', qkey, id)
    redis.call('HDEL', p .. 'sched:job', id)
    local head = redis.call('ZRANGE', qkey, 0, 0, 'WITHSCORES')
    if #head == 0 then
      redis.call('ZREM', p .. 'sched:u:' .. q, m.owner)
    else
      redis.call('ZADD', p .. 'sched:u:' .. q, head[2], m.owner)
    end
    if redis.call('HINCRBY', p .. 'sched:active:' .. m.job_class, m.owner, -1) <= 0 then
      redis.call('HDEL', p .. 'sched:active:' .. m.job_class, m.owner)
    end
    redis.call('ZREM', ready_key(m.job_class, m.priority), id)
    found = true
  else  -- not in the per-user keys: wherever it is in the serving order
    for _, c in ipairs(classes) do
      for q = max_prio, min_prio, -1 do
        if redis.call('ZREM', ready_key(c, q), id) == 1 then
          found = true
        end
      end
    end
  end
  if found then
    removed = removed + 1
  end
end
return removed
