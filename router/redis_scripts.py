"""Lua scripts of ``redis_index.RedisIndex``: lookup, event apply, heartbeat, sweep, remove.

Owns the server-side half of the Redis index so that each operation is one atomic round
trip. The key layout is documented in ``redis_index``; ``APPLY_LUA`` mirrors
``liveness.decide`` line for line (the shared contract tests hold both to the same rules).
A script that fails raises ``redis.exceptions.ResponseError`` in the caller: a bug, never
a routing outcome.
"""

from __future__ import annotations

# Shared helpers. KEYS[1] is always the ``replicas`` hash; ``prefix`` is the namespace.
_HELPERS = """
local function forget(prefix, rid)
  redis.call('DEL', prefix .. 'stream:' .. rid, prefix .. 'dev:' .. rid,
             prefix .. 'host:' .. rid, prefix .. 'spec:' .. rid)
  redis.call('HDEL', KEYS[1], rid)
end

local function sweep(now, prefix)
  local reps = redis.call('HGETALL', KEYS[1])
  local removed = {}
  for i = 1, #reps, 2 do
    if tonumber(reps[i + 1]) <= now then
      forget(prefix, reps[i])
      removed[#removed + 1] = reps[i]
    end
  end
  return removed
end

local function refresh(prefix, rid, ttl_ms)
  for _, kind in ipairs({'stream:', 'dev:', 'host:', 'spec:'}) do
    redis.call('PEXPIRE', prefix .. kind .. rid, ttl_ms)
  end
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
end
"""

# ARGV: now, prefix, block hashes... Returns {replica, device_blocks, host_blocks, ...} for
# live replicas holding the first block. Chunks start small and double, so a miss costs a
# few set probes per replica while a long hit costs O(matched blocks) in few commands.
MATCH_LUA = """
local now = tonumber(ARGV[1])
local prefix = ARGV[2]
local first, last = 3, #ARGV
local FIRST_CHUNK, MAX_CHUNK = 8, 1024
local reps = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #reps, 2 do
  local rid = reps[i]
  if tonumber(reps[i + 1]) > now then
    local dkey, hkey, skey = prefix .. 'dev:' .. rid, prefix .. 'host:' .. rid, prefix .. 'spec:' .. rid
    local has_d = redis.call('EXISTS', dkey) == 1
    local has_h = redis.call('EXISTS', hkey) == 1
    local has_s = redis.call('EXISTS', skey) == 1
    local ndev, nhost, phase, stopped = 0, 0, 1, false
    local a, chunk = first, FIRST_CHUNK
    while (has_d or has_h or has_s) and a <= last and not stopped do
      local b = math.min(a + chunk - 1, last)
      local d, h, s = false, false, false
      if has_d then d = redis.call('SMISMEMBER', dkey, unpack(ARGV, a, b)) end
      if has_h then h = redis.call('SMISMEMBER', hkey, unpack(ARGV, a, b)) end
      if has_s then s = redis.call('ZMSCORE', skey, unpack(ARGV, a, b)) end
      for j = 1, b - a + 1 do
        local on_dev = (d and d[j] == 1) or (s and s[j] and tonumber(s[j]) > now)
        local on_host = h and h[j] == 1
        if phase == 1 and on_dev then
          ndev = ndev + 1
        elseif on_dev or on_host then
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

# KEYS: replicas, stream, dev, host, spec. ARGV: replica, epoch, seq, deadline, ttl_ms, then
# per event: kind (s|r|c), tier (d|h), count, hashes... Returns applied|ignored|stale.
APPLY_LUA = (
    _HELPERS
    + """
local rid, epoch, seq = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local st = redis.call('HMGET', KEYS[2], 'epoch', 'seq', 'stale')
local known, s_epoch, s_seq, s_stale = st[1], tonumber(st[1]), tonumber(st[2]), st[3] == '1'
if known and epoch < s_epoch then return 'ignored' end
local clean = (seq == 0) or (ARGV[6] == 'c')
local action, stale
if (not known) or epoch > s_epoch or s_seq == nil then
  stale = not clean
  if clean then action = 'drop_apply' else action = 'drop_stale' end
else
  if seq <= s_seq then return 'ignored' end
  local gap = seq ~= s_seq + 1
  stale = (s_stale or gap) and not clean
  if clean and (gap or s_stale) then action = 'drop_apply'
  elseif stale and gap then action = 'drop_stale'
  elseif stale then action = 'still_stale'
  else action = 'apply' end
end
local stale_flag = '0'
if stale then stale_flag = '1' end
redis.call('HSET', KEYS[2], 'epoch', epoch, 'seq', seq, 'stale', stale_flag)
redis.call('HSET', KEYS[1], rid, ARGV[4])
if action == 'drop_apply' or action == 'drop_stale' then
  redis.call('DEL', KEYS[3], KEYS[4], KEYS[5])
end
local applied = action == 'apply' or action == 'drop_apply'
if applied then
  local i = 6
  while i <= #ARGV do
    local kind, tier, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
    local key = KEYS[3]
    if tier == 'h' then key = KEYS[4] end
    local a, stop = i + 3, i + 2 + n
    if kind == 'c' then
      redis.call('DEL', KEYS[3], KEYS[4])
    end
    while kind ~= 'c' and a <= stop do
      local b = math.min(a + 999, stop)
      if kind == 's' then
        redis.call('SADD', key, unpack(ARGV, a, b))
      else
        redis.call('SREM', key, unpack(ARGV, a, b))
      end
      a = b + 1
    end
    i = stop + 1
  end
end
for k = 1, 5 do redis.call('PEXPIRE', KEYS[k], ARGV[5]) end
if applied then return 'applied' end
return 'stale'
"""
)

# KEYS: replicas. ARGV: replica, epoch, now, deadline, ttl_ms, prefix. Returns 1, or 0 when
# the epoch is older than the known one (a late heartbeat of a restarted engine).
HEARTBEAT_LUA = (
    _HELPERS
    + """
local rid, epoch, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[6]
sweep(tonumber(ARGV[3]), prefix)
local skey = prefix .. 'stream:' .. rid
local known = redis.call('HGET', skey, 'epoch')
if known and epoch < tonumber(known) then return 0 end
if (not known) or epoch > tonumber(known) then
  forget(prefix, rid)
  redis.call('HSET', skey, 'epoch', epoch, 'stale', '0')
end
redis.call('HSET', KEYS[1], rid, ARGV[4])
refresh(prefix, rid, ARGV[5])
return 1
"""
)

# KEYS: replicas. ARGV: now, prefix. Returns the ids of the dead replicas it removed.
SWEEP_LUA = _HELPERS + "\nreturn sweep(tonumber(ARGV[1]), ARGV[2])\n"

# KEYS: replicas. ARGV: replica, prefix.
REMOVE_LUA = _HELPERS + "\nforget(ARGV[2], ARGV[1])\nreturn 1\n"
