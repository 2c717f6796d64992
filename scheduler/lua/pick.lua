-- The user queues of one model that win the next picks, in the policy's order
-- (scheduler/policy.py), and their oldest jobs. ARGV[5..10]: model, now, aging seconds, queues
-- wanted, jobs per queue, top level; ARGV[11..]: each class's base level for this group
-- (policy.class_bases), in the order of ARGV[2].
-- Returns JSON: {"queues": [{"job_class", "owner", "served", "jobs": [{"id", "due", "meta"}]}]},
-- queues in pick order, jobs oldest first; meta is the job's JobMeta, or false when the job is
-- being removed.
local model = ARGV[5]
local now, aging = tonumber(ARGV[6]), tonumber(ARGV[7])
local want, count, top_level = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local base = {}
for i, class in ipairs(classes) do
  base[class] = tonumber(ARGV[10 + i])
end
local function level(b, due)
  local waited = math.max(0, now - due)
  return math.min(top_level, b + math.floor(waited / aging))
end
-- 1. the oldest head of every (class, priority): the highest level each can offer
local heads, top = {}, -1
for _, class in ipairs(classes) do
  for prio = max_prio, min_prio, -1 do
    local key = p .. 'sched:u:' .. queue_name(model, class, prio)
    local h = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    if #h > 0 and tonumber(h[2]) <= now then
      local b = base[class] + prio
      local highest = level(b, tonumber(h[2]))
      heads[#heads + 1] = {key = key, class = class, prio = prio, base = b, highest = highest}
      top = math.max(top, highest)
    end
  end
end
-- 2. level by level from the top: the user queues whose head is at that level, least served
--    first (oldest first at the top level), until `want` queues are picked
local picked, L = {}, top
while L >= 0 and #picked < want do
  local band = {}
  for _, h in ipairs(heads) do
    if h.highest >= L and L >= h.base then
      local newest, r = now - (L - h.base) * aging, nil
      if L < top_level then
        local oldest = '(' .. tostring(now - (L - h.base + 1) * aging)
        r = redis.call('ZRANGEBYSCORE', h.key, oldest, newest, 'WITHSCORES')
      else  -- oldest first: the first `want` of each key are enough
        r = redis.call('ZRANGEBYSCORE', h.key, '-inf', newest, 'WITHSCORES', 'LIMIT', 0, want)
      end
      for j = 1, #r, 2 do
        local served = 0
        if L < top_level then
          served = tonumber(redis.call('HGET', p .. 'sched:served:' .. h.class, r[j]) or '0')
        end
        band[#band + 1] = {class = h.class, prio = h.prio, owner = r[j],
                           head_due = tonumber(r[j + 1]), served = served}
      end
    end
  end
  table.sort(band, function(x, y)
    if x.served ~= y.served then return x.served < y.served end
    return x.head_due < y.head_due
  end)
  for i = 1, math.min(#band, want - #picked) do
    picked[#picked + 1] = band[i]
  end
  L = L - 1
end
-- 3. each picked queue's `count` oldest jobs with their JobMeta, and the user's service
local queues = {}
for _, q in ipairs(picked) do
  local qkey = p .. 'sched:q:' .. queue_name(model, q.class, q.prio) .. ':' .. q.owner
  local jobs = {}
  local r = redis.call('ZRANGE', qkey, 0, count - 1, 'WITHSCORES')
  for j = 1, #r, 2 do
    jobs[#jobs + 1] = {id = r[j], due = r[j + 1],
                       meta = redis.call('HGET', p .. 'sched:job', r[j])}
  end
  queues[#queues + 1] = {
    job_class = q.class, owner = q.owner, jobs = jobs,
    served = redis.call('HGET', p .. 'sched:served:' .. q.class, q.owner) or '0'}
end
return cjson.encode({queues = queues})
