"""Lua scripts of ``redis_index.RedisIndex``: lookup, events, speculation, heartbeat, sweep.

Owns the server-side half of the Redis index so that each operation is one atomic round
trip. The key layout is documented in ``redis_index``; ``APPLY_LUA`` mirrors
``liveness.decide`` rule for rule (the shared contract tests hold both to the same rules).

Calling convention: ``KEYS[1]`` is the namespace's ``replicas`` hash; ``ARGV[1..3]`` are the
namespace prefix, the caller's clock (seconds) and the speculative bucket width (seconds);
script arguments follow from ``ARGV[4]``. Block hashes travel joined into one argument
(16 bytes each) so the client does not encode hundreds of arguments per call. Scripts derive
per-replica keys from the prefix, hence standalone Redis only. A script that fails raises
``redis.exceptions.ResponseError`` in the caller: a bug, never a routing outcome.
"""

from __future__ import annotations

# Speculative entries live in sets bucketed by expiry time; a lookup reads the buckets that
# can still hold live entries: the current one and this many after it, so a speculative ttl
# may be up to this many bucket widths.
SPEC_BUCKETS_AHEAD = 2

_HELPERS = (
    f"local SPEC_BUCKETS_AHEAD = {SPEC_BUCKETS_AHEAD}\n"
    + """
local prefix, now, bucket_s = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local current_bucket = math.floor(now / bucket_s)

local function spec_key(rid, bucket)
  return prefix .. 'spec:' .. rid .. ':' .. string.format('%d', bucket)
end

local function forget(rid)
  redis.call('DEL', prefix .. 'stream:' .. rid, prefix .. 'dev:' .. rid, prefix .. 'host:' .. rid)
  for b = current_bucket - 1, current_bucket + SPEC_BUCKETS_AHEAD do
    redis.call('DEL', spec_key(rid, b))
  end
end

local function sweep()
  local reps = redis.call('HGETALL', KEYS[1])
  local removed = {}
  for i = 1, #reps, 2 do
    if tonumber(reps[i + 1]) <= now then
      forget(reps[i])
      redis.call('HDEL', KEYS[1], reps[i])
      removed[#removed + 1] = reps[i]
    end
  end
  return removed
end

local function split(joined, first, last)
  local out = {}
  for i = first, last do
    out[#out + 1] = string.sub(joined, 16 * i - 15, 16 * i)
  end
  return out
end

local function refresh(rid, ttl_ms)
  for _, kind in ipairs({'stream:', 'dev:', 'host:'}) do
    redis.call('PEXPIRE', prefix .. kind .. rid, ttl_ms)
  end
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
end
"""
)

# ARGV[4]: the request's block hashes joined. Returns {replica, device_blocks, host_blocks,
# ...} for live replicas holding the first block. Chunks start small and double, so a miss
# costs a few set probes per replica while a long hit costs O(matched blocks); host and
# speculative sets are read only for chunks the device set does not fully cover.
MATCH_LUA = (
    _HELPERS
    + """
local joined = ARGV[4]
local num_blocks = #joined / 16
-- 32 blocks (512 tokens) cost about as much as one block per SMISMEMBER; doubling from
-- there keeps a long hit to a handful of calls per replica.
local FIRST_CHUNK, MAX_CHUNK = 32, 1024
local reps = redis.call('HGETALL', KEYS[1])
local out = {}
local hashes = {}
for i = 1, #reps, 2 do
  local rid = reps[i]
  if tonumber(reps[i + 1]) > now then
    local dkey, hkey = prefix .. 'dev:' .. rid, prefix .. 'host:' .. rid
    local has_d = redis.call('EXISTS', dkey) == 1
    local has_h = redis.call('EXISTS', hkey) == 1
    local skeys = {}
    for b = current_bucket, current_bucket + SPEC_BUCKETS_AHEAD do
      local key = spec_key(rid, b)
      if redis.call('EXISTS', key) == 1 then skeys[#skeys + 1] = key end
    end
    local ndev, nhost, phase, stopped = 0, 0, 1, false
    local a, chunk = 1, FIRST_CHUNK
    while (has_d or has_h or #skeys > 0) and a <= num_blocks and not stopped do
      local b = math.min(a + chunk - 1, num_blocks)
      if #hashes < b then
        local more = split(joined, #hashes + 1, b)
        for j = 1, #more do hashes[#hashes + 1] = more[j] end
      end
      local n = b - a + 1
      local on_dev, on_host = {}, {}
      local first_miss = 1
      if has_d then
        first_miss = n + 1
        local d = redis.call('SMISMEMBER', dkey, unpack(hashes, a, b))
        for j = 1, n do
          on_dev[j] = d[j] == 1
          if first_miss > n and not on_dev[j] then first_miss = j end
        end
      end
      if first_miss <= n then
        -- Only the part of the chunk past the device run can need the other sets, and none
        -- of it when they lack its first block (the common miss: one probe per set).
        local lo = a + first_miss - 1
        local any = false
        for _, key in ipairs(skeys) do
          any = any or redis.call('SISMEMBER', key, hashes[lo]) == 1
        end
        if has_h then any = any or redis.call('SISMEMBER', hkey, hashes[lo]) == 1 end
        for _, key in ipairs(any and skeys or {}) do
          local s = redis.call('SMISMEMBER', key, unpack(hashes, lo, b))
          for j = first_miss, n do on_dev[j] = on_dev[j] or s[j - first_miss + 1] == 1 end
        end
        if any and has_h then
          local h = redis.call('SMISMEMBER', hkey, unpack(hashes, lo, b))
          for j = first_miss, n do on_host[j] = h[j - first_miss + 1] == 1 end
        end
      end
      for j = 1, n do
        if phase == 1 and on_dev[j] then
          ndev = ndev + 1
        elseif on_dev[j] or on_host[j] then
          phase = 2
          nhost = nhost + 1
        else
          stopped = true
          break
        end
      end
      a = b + 1
      chunk = math.min(chunk * 2, MAX_CHUNK)
    end
    if ndev + nhost > 0 then
      out[#out + 1] = rid
      out[#out + 1] = ndev
      out[#out + 1] = nhost
    end
  end
end
return out
"""
)

# ARGV[4..]: replica, epoch, seq, deadline, key ttl_ms, then per event: kind (s|r|c), tier
# (d|h), hashes joined. Returns applied|ignored|stale.
APPLY_LUA = (
    _HELPERS
    + """
local rid, epoch, seq = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local skey, dkey, hkey = prefix .. 'stream:' .. rid, prefix .. 'dev:' .. rid,
  prefix .. 'host:' .. rid
local st = redis.call('HMGET', skey, 'epoch', 'seq', 'stale')
local known, s_epoch, s_seq, s_stale = st[1], tonumber(st[1]), tonumber(st[2]), st[3] == '1'
if known and epoch < s_epoch then return 'ignored' end
local FIRST_EVENT = 9
local clean = (seq == 0) or (ARGV[FIRST_EVENT] == 'c')
local action, stale
if (not known) or epoch > s_epoch or s_seq == nil then
  stale = not clean
  if clean then action = 'drop_apply' else action = 'drop_stale' end
elseif seq == 0 then
  stale = false
  action = 'drop_apply'
else
  if seq <= s_seq then return 'ignored' end
  local gap = seq ~= s_seq + 1
  stale = (s_stale or gap) and not clean
  if clean and (gap or s_stale) then action = 'drop_apply'
  elseif stale and gap then action = 'drop_stale'
  elseif stale then action = 'still_stale'
  else action = 'apply' end
end
if action == 'drop_apply' or action == 'drop_stale' then forget(rid) end
local stale_flag = '0'
if stale then stale_flag = '1' end
redis.call('HSET', skey, 'epoch', epoch, 'seq', seq, 'stale', stale_flag)
redis.call('HSET', KEYS[1], rid, ARGV[7])
local applied = action == 'apply' or action == 'drop_apply'
if applied then
  for i = FIRST_EVENT, #ARGV, 3 do
    local kind, tier, joined = ARGV[i], ARGV[i + 1], ARGV[i + 2]
    local key = dkey
    if tier == 'h' then key = hkey end
    if kind == 'c' then redis.call('DEL', dkey, hkey) end
    local a, num = 1, #joined / 16
    while kind ~= 'c' and a <= num do
      local b = math.min(a + 999, num)
      if kind == 's' then
        redis.call('SADD', key, unpack(split(joined, a, b)))
      else
        redis.call('SREM', key, unpack(split(joined, a, b)))
      end
      a = b + 1
    end
  end
end
refresh(rid, ARGV[8])
if applied then return 'applied' end
return 'stale'
"""
)

# ARGV[4..]: replica, ttl_s, hashes joined. Adds the hashes to the bucket of their expiry;
# the bucket key expires one bucket after its last possible entry.
SPECULATIVE_LUA = (
    _HELPERS
    + """
local rid, joined = ARGV[4], ARGV[6]
local bucket = math.floor((now + tonumber(ARGV[5])) / bucket_s)
local key = spec_key(rid, bucket)
local num = #joined / 16
local a = 1
while a <= num do
  local b = math.min(a + 999, num)
  redis.call('SADD', key, unpack(split(joined, a, b)))
  a = b + 1
end
redis.call('PEXPIRE', key, math.ceil(((bucket + 2) * bucket_s - now) * 1000))
return num
"""
)

# ARGV[4..]: replica, epoch, deadline, key ttl_ms. Sweeps dead replicas first. Returns 1, or
# 0 when the epoch is older than the known one (a late heartbeat of a restarted engine).
HEARTBEAT_LUA = (
    _HELPERS
    + """
local rid, epoch = ARGV[4], tonumber(ARGV[5])
sweep()
local skey = prefix .. 'stream:' .. rid
local known = redis.call('HGET', skey, 'epoch')
if known and epoch < tonumber(known) then return 0 end
if (not known) or epoch > tonumber(known) then
  forget(rid)
  redis.call('HSET', skey, 'epoch', epoch, 'stale', '0')
end
redis.call('HSET', KEYS[1], rid, ARGV[6])
refresh(rid, ARGV[7])
return 1
"""
)

# Returns the ids of the dead replicas it removed.
SWEEP_LUA = _HELPERS + "\nreturn sweep()\n"

# ARGV[4]: replica.
REMOVE_LUA = _HELPERS + "\nforget(ARGV[4])\nredis.call('HDEL', KEYS[1], ARGV[4])\nreturn 1\n"
