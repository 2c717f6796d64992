-- Charges a started job to its user. ARGV[5]: job id; ARGV[6]: the record's TTL in seconds;
-- ARGV[7]: the ChargeRecord, stored as given. The class's virtual time moves up to the user's
-- service before the charge: the level of the latest pick.
local c = cjson.decode(ARGV[7])
local served_key = p .. 'sched:served:' .. c.job_class
local vtime_key = p .. 'sched:vtime:' .. c.job_class
local served = redis.call('HGET', served_key, c.owner) or '0'
if tonumber(served) > tonumber(redis.call('GET', vtime_key) or '0') then
  redis.call('SET', vtime_key, served)
end
redis.call('HINCRBYFLOAT', served_key, c.owner, c.charged_seconds)
redis.call('SET', p .. 'sched:charge:' .. ARGV[5], ARGV[7], 'EX', tonumber(ARGV[6]))
return 1
