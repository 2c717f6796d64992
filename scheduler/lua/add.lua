-- Indexes queued jobs. ARGV[5]: wake tokens to keep (0: push none); ARGV[6]: '1' to return the
-- last job's position; then three per job: id, due time, JobMeta.
-- Returns {jobs new to the per-user keys, the last job's position or -1}.
local wake_cap, want_position = tonumber(ARGV[5]), ARGV[6] == '1'
local added, last_id, last = 0, nil, nil
for i = 7, #ARGV, 3 do
  local id, due, raw = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local m = cjson.decode(raw)
  local q = queue_name(m.model, m.job_class, m.priority)
  redis.call('ZADD', ready_key(m.job_class, m.priority), due, id)
  if redis.call('HEXISTS', p .. 'sched:job', id) == 0 then
    redis.call('HSET', p .. 'sched:job', id, raw)
    redis.call('ZADD', p .. 'sched:q:' .. q .. ':' .. m.owner, due, id)
    redis.call('ZADD', p .. 'sched:u:' .. q, 'LT', due, m.owner)
    -- a user entering the class starts at its virtual time: idle time is neither credit nor debt
    if redis.call('HINCRBY', p .. 'sched:active:' .. m.job_class, m.owner, 1) == 1 then
      local served_key = p .. 'sched:served:' .. m.job_class
      local vt = redis.call('GET', p .. 'sched:vtime:' .. m.job_class) or '0'
      if tonumber(redis.call('HGET', served_key, m.owner) or '0') < tonumber(vt) then
        redis.call('HSET', served_key, m.owner, vt)
      end
    end
    added = added + 1
  end
  last_id, last = id, m
end
if last and wake_cap > 0 then
  redis.call('RPUSH', p .. 'ready:wake', '1')
  redis.call('LTRIM', p .. 'ready:wake', -wake_cap, -1)
end
local pos = -1
if last and want_position then
  pos = position(last_id, last.job_class, last.priority)
end
return {added, pos}
