-- ARGV[5..7]: job id, class, priority. Entries ahead of the job in serving order, or -1.
return position(ARGV[5], ARGV[6], tonumber(ARGV[7]))
