-- Loaded in front of every script of the queue index (scheduler/queue_index.py).
-- ARGV[1]: the key prefix; ARGV[2]: the classes in serving order, comma-separated; ARGV[3],
-- ARGV[4]: the highest and the lowest priority. A script's own arguments start at ARGV[5].
-- Records are decoded by field name (scheduler/records.py): m for a JobMeta, c for a
-- ChargeRecord.
local p = ARGV[1]
local classes = {}
for class in string.gmatch(ARGV[2], '[^,]+') do
  classes[#classes + 1] = class
end
local max_prio, min_prio = tonumber(ARGV[3]), tonumber(ARGV[4])

local function ready_key(class, prio)
  return p .. 'ready:' .. class .. ':' .. prio
end

-- Q: one (model, class, priority) queue, split by user in the sched:q and sched:u keys
local function queue_name(model, class, prio)
  return model .. ':' .. class .. ':' .. prio
end

-- entries ahead of the job in serving order, -1 if it is not in its ready key
local function position(id, class, prio)
  local ahead = 0
  for _, c in ipairs(classes) do
    for q = max_prio, min_prio, -1 do
      local key = ready_key(c, q)
      if c == class and q == prio then
        local rank = redis.call('ZRANK', key, id)
        if not rank then
          return -1
        end
        return ahead + rank
      end
      ahead = ahead + redis.call('ZCARD', key)
    end
  end
  return -1
end
