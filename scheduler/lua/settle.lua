-- What a claim does to the index once its jobs are claimed, in one call: charges the started
-- jobs to their users, then drops the jobs it is done with from every key.
-- ARGV[5]: the charge records' TTL in seconds; ARGV[6]: n, the started jobs; ARGV[7..6+2n]:
-- job id, ChargeRecord (stored as given) for each; the rest: ids of the jobs to drop.
-- Returns how many of those were in the index.
local ttl, n = tonumber(ARGV[5]), tonumber(ARGV[6])
for i = 7, 6 + 2 * n, 2 do
  local c = cjson.decode(ARGV[i + 1])
  local served_key = p .. 'sched:served:' .. c.job_class
  local vtime_key = p .. 'sched:vtime:' .. c.job_class
  -- the class's virtual time moves up to the user's service before the charge: the service
  -- level of the latest pick
  local served = redis.call('HGET', served_key, c.owner) or '0'
  if tonumber(served) > tonumber(redis.call('GET', vtime_key) or '0') then
    redis.call('SET', vtime_key, served)
  end
  redis.call('HINCRBYFLOAT', served_key, c.owner, c.charged_seconds)
  redis.call('SET', p .. 'sched:charge:' .. ARGV[i], ARGV[i + 1], 'EX', ttl)
end

local removed = 0
for i = 7 + 2 * n, #ARGV do
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
    for _, class in ipairs(classes) do
      for prio = max_prio, min_prio, -1 do
        if redis.call('ZREM', ready_key(class, prio), id) == 1 then
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
