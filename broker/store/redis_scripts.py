"""The Lua scripts :class:`~broker.store.redis.RedisStateStore` runs: each keeps a record
and its index entries in step in one round trip. Key names follow the table in
:mod:`broker.store.redis`; ``ARGV`` prefixes let a script name the keys it derives."""

from __future__ import annotations

# KEYS: rank, ranks, engine, lease, stream, cursor, contacts, backlog, agent, leases, and the
#       deployment index of a data-parallel rank's engine
# ARGV: member, tp_rank, registration, metadata, lease_id, expires, registered, generation,
#       ttl_ms, lease prefix, agent prefix, agent name
PUT_RANK = """
local old_lease, old_agent = unpack(redis.call('HMGET', KEYS[1], 'lease', 'agent'))
if old_lease and old_lease ~= ARGV[5] then redis.call('DEL', ARGV[10] .. old_lease) end
if old_agent and old_agent ~= ARGV[12] then redis.call('DEL', ARGV[11] .. old_agent) end
redis.call('HSET', KEYS[1], 'reg', ARGV[3], 'meta', ARGV[4], 'lease', ARGV[5], 'exp', ARGV[6],
           'at', ARGV[7], 'gen', ARGV[8], 'agent', ARGV[12])
redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[9])
redis.call('SET', KEYS[9], ARGV[1], 'PX', ARGV[9])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[10], ARGV[6], ARGV[1])
if KEYS[11] then redis.call('SADD', KEYS[11], ARGV[1]) end
for i = 1, 8 do
  if i ~= 2 and i ~= 3 then redis.call('PEXPIRE', KEYS[i], ARGV[9]) end
end
"""
# KEYS: rank, ranks, engine, leases, and the deployment index of a data-parallel rank's engine
# ARGV: member, tp_rank, lease prefix, agent prefix
DELETE_RANK = """
local lease, agent = unpack(redis.call('HMGET', KEYS[1], 'lease', 'agent'))
if lease then redis.call('DEL', ARGV[3] .. lease) end
if agent then redis.call('DEL', ARGV[4] .. agent) end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[2])
redis.call('ZREM', KEYS[4], ARGV[1])
if KEYS[5] then redis.call('SREM', KEYS[5], ARGV[1]) end
"""
# KEYS: the engine index and the deployment index of each name; ARGV: rank key prefix, then
# the names. Returns the members of the ranks those indexes name whose record Redis still
# holds.
NAMED = """
local found = {}
local function add_live(member)
  if redis.call('EXISTS', ARGV[1] .. member) == 1 then table.insert(found, member) end
end
for i = 2, #ARGV do
  for _, tp in ipairs(redis.call('SMEMBERS', KEYS[2 * i - 3])) do add_live(tp .. ':' .. ARGV[i]) end
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[2 * i - 2])) do add_live(member) end
end
return found
"""
# KEYS: engine; ARGV: rank key prefix, engine id. Returns [tp_rank, reg, meta, lease, exp, at,
# gen] per member of the engine's set.
ENGINE = """
local rows = {}
for _, tp in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local row = redis.call('HMGET', ARGV[1] .. tp .. ':' .. ARGV[2],
                         'reg', 'meta', 'lease', 'exp', 'at', 'gen')
  table.insert(rows, {tp, unpack(row)})
end
return rows
"""
# A transfer's hold on its prefill engine's quota: field `q` of its hash (block ids held) is
# counted in the usage hash named by its field `u` (`t` transfers, `i` block ids). recount()
# replaces it.
_USAGE = """
local function recount(transfer, usage, held)
  local before = tonumber(redis.call('HGET', transfer, 'q') or '0')
  if before == held then return end
  if before > 0 then
    redis.call('HINCRBY', usage, 't', -1)
    redis.call('HINCRBY', usage, 'i', -before)
  end
  if held > 0 then
    redis.call('HINCRBY', usage, 't', 1)
    redis.call('HINCRBY', usage, 'i', held)
  end
  redis.call('HSET', transfer, 'q', held, 'u', usage)
end
"""
# KEYS: transfer, deadlines, transfers, usage, named, party index of each party
# ARGV: member, record, deadline, plan ids, plans or '', ttl_ms, block ids held, plan prefix,
#       parties (JSON)
PUT_TRANSFER = (
    _USAGE
    + """
if redis.call('HGET', KEYS[1], 'd') ~= ARGV[3] then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
end
recount(KEYS[1], KEYS[4], tonumber(ARGV[7]))
redis.call('HSET', KEYS[1], 'm', ARGV[2], 'd', ARGV[3], 'ids', ARGV[4], 'named', KEYS[5],
           'parties', ARGV[9])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'p', ARGV[5]) end
for plan in string.gmatch(ARGV[4], '%S+') do
  redis.call('SET', ARGV[8] .. plan, ARGV[1], 'PX', ARGV[6])
end
redis.call('SADD', KEYS[3], ARGV[1])
redis.call('SADD', KEYS[5], ARGV[1])
for i = 6, #KEYS do redis.call('SADD', KEYS[i], ARGV[1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('PEXPIRE', KEYS[4], ARGV[6])
"""
)
# KEYS: transfer, deadlines, transfers; ARGV: member, plan prefix, party index prefix
DELETE_TRANSFER = (
    _USAGE
    + """
local usage = redis.call('HGET', KEYS[1], 'u')
if usage then recount(KEYS[1], usage, 0) end
local ids, named, parties = unpack(redis.call('HMGET', KEYS[1], 'ids', 'named', 'parties'))
if ids then
  for plan in string.gmatch(ids, '%S+') do redis.call('DEL', ARGV[2] .. plan) end
end
if named then redis.call('SREM', named, ARGV[1]) end
if parties then
  for _, engine in ipairs(cjson.decode(parties)) do
    redis.call('SREM', ARGV[3] .. engine, ARGV[1])
  end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
"""
)
# KEYS: deadlines; ARGV: now, redeliver at, transfer key prefix, most members. Hands each
# due member out once per redelivery interval (until it is put with a new deadline or
# deleted), the earliest first; forgets members whose record Redis already forgot.
DUE = """
local due = {}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[4])) do
  if redis.call('EXISTS', ARGV[3] .. member) == 1 then
    redis.call('ZADD', KEYS[1], ARGV[2], member)
    table.insert(due, member)
  else
    redis.call('ZREM', KEYS[1], member)
  end
end
return due
"""
# KEYS: leases; ARGV: now, rank key prefix. Ranks whose lease expired; forgets members whose
# record Redis already forgot.
DUE_LEASES = """
local due = {}
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])) do
  if redis.call('EXISTS', ARGV[2] .. member) == 1 then
    table.insert(due, member)
  else
    redis.call('ZREM', KEYS[1], member)
  end
end
return due
"""
# Release backlog accounting shared by the scripts below: ARGV[1] is the key prefix. drop()
# forgets the oldest `count` events of rank `member` (all of them with count < 0).
_BACKLOG = """
local prefix = ARGV[1]
local function drop(member, count)
  local stream, backlog = prefix .. 'releases:' .. member, prefix .. 'backlog:' .. member
  local entries = redis.call('XRANGE', stream, '-', '+', 'COUNT', count < 0 and 1000000000 or count)
  local size, last = 0, nil
  for _, entry in ipairs(entries) do
    local fields = entry[2]
    for i = 1, #fields, 2 do
      if fields[i] == 'b' then size = size + tonumber(fields[i + 1]) end
    end
    redis.call('XDEL', stream, entry[1])
    last = entry[1]
  end
  if last then
    redis.call('HINCRBY', backlog, 'bytes', -size)
    redis.call('HSET', backlog, 'compacted', string.match(last, '^(%d+)'))
    redis.call('DECRBY', prefix .. 'backlog', size)
    redis.call('ZINCRBY', prefix .. 'backlogs', -size, member)
  end
  return #entries
end
"""
# KEYS: stream, counter, backlog; ARGV: prefix, event, channel, member, ttl_ms, bytes,
# rank budget, total budget. Returns the sequence.
APPEND = (
    _BACKLOG
    + """
local member = ARGV[4]
local seq = redis.call('INCR', KEYS[2])
redis.call('XADD', KEYS[1], seq .. '-0', 'e', ARGV[2], 'b', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('HINCRBY', KEYS[3], 'bytes', ARGV[6])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
redis.call('INCRBY', prefix .. 'backlog', ARGV[6])
redis.call('ZINCRBY', prefix .. 'backlogs', ARGV[6], member)
while tonumber(redis.call('HGET', KEYS[3], 'bytes')) > tonumber(ARGV[7]) do
  if drop(member, 1) == 0 then break end
end
while tonumber(redis.call('GET', prefix .. 'backlog')) > tonumber(ARGV[8]) do
  local top = redis.call('ZREVRANGE', prefix .. 'backlogs', 0, 0, 'WITHSCORES')
  if #top == 0 then break end
  if drop(top[1], 1) == 0 then  -- its stream expired with its rank: forget what it counted
    redis.call('ZREM', prefix .. 'backlogs', top[1])
    redis.call('DECRBY', prefix .. 'backlog', math.floor(tonumber(top[2])))
  end
end
redis.call('PUBLISH', ARGV[3], member)
return seq
"""
)
# KEYS: cursor; ARGV: sequence, ttl_ms
MARK = """
if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
"""
# KEYS: stream, cursor; ARGV: prefix, member, keep. Keeps every undelivered event and `keep`
# delivered ones.
TRIM = (
    _BACKLOG
    + """
local cursor = redis.call('GET', KEYS[2])
if not cursor then return 0 end
local delivered = #redis.call('XRANGE', KEYS[1], '-', cursor .. '-0')
local keep = tonumber(ARGV[3])
if delivered > keep then return drop(ARGV[2], delivered - keep) end
return 0
"""
)
# KEYS: stream, cursor, backlog; ARGV: prefix, member, channel. Forgets the rank's queue.
DROP = (
    _BACKLOG
    + """
drop(ARGV[2], -1)
-- Whatever the rank still counts (events written before backlogs were counted) goes too.
local left = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
redis.call('DECRBY', prefix .. 'backlog', left)
redis.call('ZREM', prefix .. 'backlogs', ARGV[2])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('PUBLISH', ARGV[3], ARGV[2])
"""
)

SCRIPTS = {
    "put_rank": PUT_RANK,
    "delete_rank": DELETE_RANK,
    "engine": ENGINE,
    "named": NAMED,
    "put_transfer": PUT_TRANSFER,
    "delete_transfer": DELETE_TRANSFER,
    "due": DUE,
    "due_leases": DUE_LEASES,
    "append": APPEND,
    "mark": MARK,
    "trim": TRIM,
    "drop": DROP,
}
