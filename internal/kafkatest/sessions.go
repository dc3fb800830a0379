package kafkatest

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// SessionEnforcer gives a kfake cluster the session timeouts of Apache
// Kafka's classic group coordinator, which kfake (as pinned) does not always
// enforce.
//
// kfake gives a member that joins during a rebalance no session timer until
// it delivers the member's JoinGroup response, and arms one only if that
// delivery succeeds. A member that dies while its JoinGroup is parked (a
// consumer SIGKILLed during a rebalance) is answered on a dead connection;
// whenever kfake notices the closed connection first (about half the time)
// no timer is ever armed, and the member stays in the group for good. Once the
// group is stable it holds the partitions the leader gave it, and nobody
// reads them; at the next rebalance the group waits for it to rejoin, and
// because kfake pushes its rebalance deadline back on every join, leave
// and expiry, a group with steady churn never completes that rebalance:
// every live member's JoinGroup times out, it leaves and joins again, and
// the group stalls until the churn stops. Apache Kafka schedules the
// session expiry when it completes the join whether or not the response
// could be sent, and its join deadline is fixed, so there the dead member
// is gone one session timeout after the rebalance.
//
// The enforcer watches the group requests that carry a member id
// (JoinGroup, SyncGroup, Heartbeat, OffsetCommit) through kfake's control
// hooks, without answering them, and polls each classic group it has seen.
// A member that is neither parked in the join barrier of the current
// rebalance nor parked in SyncGroup for the current generation, and has
// sent nothing for its session timeout since the later of its last request
// and the start of the current generation, is removed with a LeaveGroup on
// its behalf, the way an operator removes a member
// (RemoveMembersFromConsumerGroup). kfake then rebalances as it does when a
// member leaves. A live client is never removed: it heartbeats, and kfake
// itself would expire a member silent for that long.
//
// The other way round, kfake keeps running the session timer of a member
// that waits in the join barrier or in SyncGroup, and expires it there,
// dropping its request unanswered (the client times out and joins
// afresh); Apache Kafka keeps such a member alive. The enforcer heartbeats
// for parked members every third of their session timeout, which kfake
// takes as a sign of life, until the member has been parked for twice its
// rebalance timeout plus its session timeout, by which time clients give
// up the request themselves.
//
// KIP-848 ("consumer" protocol) groups are not touched; kfake times their
// members out itself.
type SessionEnforcer struct {
	c        *kfake.Cluster
	interval time.Duration
	onEvict  func(Eviction)

	mu     sync.Mutex
	groups map[string]*groupTrack

	evicted atomic.Int64
	stop    chan struct{}
	done    chan struct{}
	once    sync.Once
}

// Eviction describes a member the enforcer removed.
type Eviction struct {
	Group    string
	MemberID string
	ClientID string
	// Silent is how long the member had sent nothing, measured from the
	// later of its last request and the start of the generation.
	Silent time.Duration
	// State is the group's state when it was removed.
	State string
	// Partitions is the member's assignment when it was removed.
	Partitions map[string][]int32
	// Err is set if the LeaveGroup failed; the enforcer tries again at
	// its next poll.
	Err error
}

type groupTrack struct {
	// The largest session and rebalance timeouts the group's joins asked
	// for, for members whose own are unknown (they joined without an id).
	session, rebalance time.Duration
	epoch              int32
	state              string
	epochSince         time.Time // when this enforcer first saw epoch
	members            map[string]*memberTrack
}

type memberTrack struct {
	seen      time.Time // last request with the member's id, or its first appearance
	lastKey   int16     // that request's key
	joinEpoch int32     // the epoch its last JoinGroup arrived in
	syncGen   int32     // the generation of its last SyncGroup
	session   time.Duration
	rebalance time.Duration
	// keptAlive is when the enforcer last heartbeated for the member
	// while it waited in the join barrier; ownBeat marks that heartbeat,
	// which observe must not count as the member's own request.
	keptAlive time.Time
	ownBeat   bool
}

const appeared = -1 // memberTrack.lastKey of a member first seen in a poll

// EnforceSessionTimeouts starts a SessionEnforcer on c. It polls every
// interval (defaults to 50ms when zero) and calls onEvict, if not nil, for
// every member it removes (from its own goroutine). Call Close before
// closing the cluster.
func EnforceSessionTimeouts(c *kfake.Cluster, interval time.Duration, onEvict func(Eviction)) *SessionEnforcer {
	if interval <= 0 {
		interval = 50 * time.Millisecond
	}
	e := &SessionEnforcer{c: c, interval: interval, onEvict: onEvict, groups: map[string]*groupTrack{},
		stop: make(chan struct{}), done: make(chan struct{})}
	for _, key := range []kmsg.Key{kmsg.JoinGroup, kmsg.SyncGroup, kmsg.Heartbeat, kmsg.OffsetCommit} {
		c.ControlKey(int16(key), func(req kmsg.Request) (kmsg.Response, error, bool) {
			e.observe(req)
			return nil, nil, false // observe only: kfake answers
		})
	}
	go e.run()
	return e
}

// Evicted returns how many members the enforcer has removed.
func (e *SessionEnforcer) Evicted() int { return int(e.evicted.Load()) }

// Close stops the enforcer and waits for its goroutine. It is idempotent.
// The control hooks stay installed but observe nothing once closed.
func (e *SessionEnforcer) Close() {
	e.once.Do(func() { close(e.stop) })
	<-e.done
}

func (e *SessionEnforcer) closed() bool {
	select {
	case <-e.stop:
		return true
	default:
		return false
	}
}

// observe runs on the cluster's goroutine before kfake handles req.
func (e *SessionEnforcer) observe(req kmsg.Request) {
	if e.closed() {
		return
	}
	now := time.Now()
	switch r := req.(type) {
	case *kmsg.JoinGroupRequest:
		// The group's epoch as the join arrives: a join that completes
		// the rebalance moves the epoch past it, so the member is then
		// answered, not parked. kfake serves admin calls while a control
		// function runs.
		var epoch int32
		gi := e.c.GroupInfo(r.Group)
		if gi != nil {
			epoch = gi.Epoch
		}
		session := time.Duration(r.SessionTimeoutMillis) * time.Millisecond
		rebalance := time.Duration(r.RebalanceTimeoutMillis) * time.Millisecond
		if r.Version == 0 {
			rebalance = session
		}
		e.mu.Lock()
		defer e.mu.Unlock()
		g := e.group(r.Group)
		g.session, g.rebalance = max(g.session, session), max(g.rebalance, rebalance)
		if gi != nil {
			// Members that joined without an id since the last look,
			// while their join can still be placed in its epoch.
			g.sight(gi, now)
		}
		if r.MemberID != "" {
			m := g.member(r.MemberID)
			m.seen, m.lastKey, m.joinEpoch = now, int16(kmsg.JoinGroup), epoch
			m.session, m.rebalance = session, rebalance
		}
	case *kmsg.SyncGroupRequest:
		e.touch(r.Group, r.MemberID, now, kmsg.SyncGroup, r.Generation)
	case *kmsg.HeartbeatRequest:
		e.mu.Lock()
		if g, ok := e.groups[r.Group]; ok {
			if m, ok := g.members[r.MemberID]; ok && m.ownBeat {
				m.ownBeat = false
				e.mu.Unlock()
				return
			}
		}
		e.mu.Unlock()
		e.touch(r.Group, r.MemberID, now, kmsg.Heartbeat, 0)
	case *kmsg.OffsetCommitRequest:
		e.touch(r.Group, r.MemberID, now, kmsg.OffsetCommit, 0)
	}
}

// touch records a request of member in group, if the enforcer tracks the
// group (it has seen a JoinGroup for it).
func (e *SessionEnforcer) touch(group, member string, now time.Time, key kmsg.Key, gen int32) {
	if member == "" {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	g, ok := e.groups[group]
	if !ok {
		return
	}
	m := g.member(member)
	m.seen, m.lastKey = now, int16(key)
	if key == kmsg.SyncGroup {
		m.syncGen = gen
	}
}

func (e *SessionEnforcer) group(name string) *groupTrack {
	g, ok := e.groups[name]
	if !ok {
		g = &groupTrack{members: map[string]*memberTrack{}, epoch: -1}
		e.groups[name] = g
	}
	return g
}

// member returns the track of id, creating one that counts as first seen
// now if the member is new to the enforcer.
func (g *groupTrack) member(id string) *memberTrack {
	m, ok := g.members[id]
	if !ok {
		m = &memberTrack{seen: time.Now(), lastKey: appeared, joinEpoch: g.epoch}
		g.members[id] = m
	}
	return m
}

// sight starts tracking the members of snapshot gi the enforcer has not
// seen yet: members that joined without an id (or whose requests it
// missed). If the group is rebalancing, such a member is parked in this
// rebalance's join barrier; otherwise its join was answered by the
// generation in progress. (A member that joined and was answered between
// two looks, in a group already rebalancing again, counts as parked until
// its rebalance and session timeouts have passed.)
func (g *groupTrack) sight(gi *kfake.GroupInfo, now time.Time) {
	for _, gm := range gi.Members {
		if _, ok := g.members[gm.MemberID]; ok {
			continue
		}
		m := &memberTrack{seen: now, lastKey: appeared, joinEpoch: gi.Epoch}
		if gi.State != "PreparingRebalance" {
			m.joinEpoch = gi.Epoch - 1
		}
		g.members[gm.MemberID] = m
	}
}

func (e *SessionEnforcer) run() {
	defer close(e.done)
	t := time.NewTicker(e.interval)
	defer t.Stop()
	for {
		select {
		case <-e.stop:
			return
		case <-t.C:
		}
		e.poll()
	}
}

// poll checks every tracked group once and removes the members whose
// session has expired.
func (e *SessionEnforcer) poll() {
	e.mu.Lock()
	names := make([]string, 0, len(e.groups))
	for name := range e.groups {
		names = append(names, name)
	}
	e.mu.Unlock()
	slices.Sort(names)
	for _, name := range names {
		if e.closed() {
			return
		}
		gi := e.c.GroupInfo(name)
		evictions, beats := e.expired(name, gi, time.Now())
		for _, member := range beats {
			e.keepAlive(name, gi.Epoch, member)
		}
		for _, ev := range evictions {
			ev.Err = e.leave(name, ev.MemberID)
			if ev.Err == nil {
				e.evicted.Add(1)
			}
			if e.onEvict != nil {
				e.onEvict(ev)
			}
		}
	}
}

// expired updates the track of group from its snapshot gi, taken at now,
// and returns the members to remove and the members to heartbeat for: those
// waiting in the join barrier, which Apache Kafka keeps alive while they
// wait and kfake expires at their session timeout (their JoinGroup is then
// never answered).
func (e *SessionEnforcer) expired(name string, gi *kfake.GroupInfo, now time.Time) (out []Eviction, beats []string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	g := e.groups[name]
	if g == nil {
		return nil, nil
	}
	if gi == nil || gi.State == "Dead" {
		delete(e.groups, name)
		return nil, nil
	}
	if gi.Epoch != g.epoch {
		g.epoch, g.epochSince = gi.Epoch, now
	}
	g.state = gi.State
	present := make(map[string]bool, len(gi.Members))
	for _, gm := range gi.Members {
		present[gm.MemberID] = true
		g.sight(gi, now)
		m := g.members[gm.MemberID]
		session, rebalance := m.session, m.rebalance
		if session == 0 {
			session, rebalance = g.session, g.rebalance
		}
		if session == 0 {
			continue // no join seen: nothing to go by
		}
		// A member waiting in the join barrier of this rebalance, or in
		// SyncGroup for the leader's assignment of this generation, is
		// never removed: Apache Kafka keeps such a member alive, and the
		// enforcer heartbeats for it so that kfake does too (kfake
		// expires it and drops its request unanswered, and removing a
		// member parked in SyncGroup skews kfake's count of joined
		// members, after which every rebalance waits out its deadline).
		// Clients give up a parked request by 2*rebalance+session
		// (kafka-go after its Timeout plus the rebalance timeout): a
		// member parked longer is treated like any other.
		joining := m.lastKey == int16(kmsg.JoinGroup) || m.lastKey == appeared
		parked := gi.State == "PreparingRebalance" && joining && m.joinEpoch == gi.Epoch ||
			gi.State == "CompletingRebalance" && m.lastKey == int16(kmsg.SyncGroup) && m.syncGen == gi.Epoch
		if parked && now.Sub(m.seen) < 2*rebalance+session {
			last := m.seen
			if m.keptAlive.After(last) {
				last = m.keptAlive
			}
			if now.Sub(last) >= session/3 {
				m.keptAlive, m.ownBeat = now, true
				beats = append(beats, gm.MemberID)
			}
			continue
		}
		from := m.seen
		if g.epochSince.After(from) {
			from = g.epochSince
		}
		if silent := now.Sub(from); silent > session {
			out = append(out, Eviction{Group: name, MemberID: gm.MemberID, ClientID: gm.ClientID,
				Silent: silent, State: gi.State, Partitions: gm.Assignment})
			m.seen = now // do not ask again before another session timeout
		}
	}
	for id := range g.members {
		if !present[id] {
			delete(g.members, id)
		}
	}
	return out, beats
}

// keepAlive heartbeats for member, which waits in the join barrier of
// group's rebalance away from generation gen. kfake answers
// REBALANCE_IN_PROGRESS and restarts the member's session timer.
func (e *SessionEnforcer) keepAlive(group string, gen int32, member string) {
	req := kmsg.NewPtrHeartbeatRequest()
	req.SetVersion(2)
	req.Group, req.Generation, req.MemberID = group, gen, member
	for _, addr := range e.c.ListenAddrs() {
		kresp, err := roundTrip(addr, req, 5*time.Second)
		if err == nil && kresp.(*kmsg.HeartbeatResponse).ErrorCode != kerr.NotCoordinator.Code {
			return
		}
	}
	// Not delivered: the member's own next request resets ownBeat's
	// effect anyway (touch records it); clear the mark.
	e.mu.Lock()
	if g, ok := e.groups[group]; ok {
		if m, ok := g.members[member]; ok {
			m.ownBeat = false
		}
	}
	e.mu.Unlock()
}

// leave removes member from group with a LeaveGroup (v3, which names the
// members to remove) sent to each broker until the coordinator answers.
func (e *SessionEnforcer) leave(group, member string) error {
	var last error
	for _, addr := range e.c.ListenAddrs() {
		req := kmsg.NewPtrLeaveGroupRequest()
		req.SetVersion(3)
		req.Group = group
		m := kmsg.NewLeaveGroupRequestMember()
		m.MemberID = member
		req.Members = append(req.Members, m)
		kresp, err := roundTrip(addr, req, 5*time.Second)
		if err != nil {
			last = err
			continue
		}
		resp := kresp.(*kmsg.LeaveGroupResponse)
		if err := kerr.ErrorForCode(resp.ErrorCode); err != nil {
			last = fmt.Errorf("kafkatest: remove member %s of group %s: %w", member, group, err)
			if err == kerr.NotCoordinator {
				continue
			}
			return last
		}
		for _, rm := range resp.Members {
			// UNKNOWN_MEMBER_ID: kfake expired it meanwhile.
			if err := kerr.ErrorForCode(rm.ErrorCode); err != nil && err != kerr.UnknownMemberID {
				return fmt.Errorf("kafkatest: remove member %s of group %s: %w", member, group, err)
			}
		}
		return nil
	}
	return last
}

// roundTrip sends req, which must use a non-flexible version, on a new
// connection to addr and returns the response.
func roundTrip(addr string, req kmsg.Request, timeout time.Duration) (kmsg.Response, error) {
	conn, err := net.DialTimeout("tcp", addr, timeout)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	if err := conn.SetDeadline(time.Now().Add(timeout)); err != nil {
		return nil, err
	}
	return RoundTripOn(conn, req, "kafkatest")
}

// RoundTripOn writes req on conn, with correlation id 1 and clientID, and
// reads its response. req must use a version whose request and response
// headers are not flexible (for example JoinGroup up to v5, SyncGroup up to
// v3, Heartbeat up to v3, LeaveGroup up to v3). It is meant for tests that
// drive the group protocol by hand, for instance to drop a connection while
// its request is parked in the broker.
func RoundTripOn(conn net.Conn, req kmsg.Request, clientID string) (kmsg.Response, error) {
	if req.IsFlexible() {
		return nil, fmt.Errorf("kafkatest: %T v%d is flexible; use a lower version", req, req.GetVersion())
	}
	const corr = 1
	b := kmsg.NewRequestFormatter(kmsg.FormatterClientID(clientID)).AppendRequest(nil, req, corr)
	if _, err := conn.Write(b); err != nil {
		return nil, err
	}
	var size [4]byte
	if _, err := io.ReadFull(conn, size[:]); err != nil {
		return nil, err
	}
	body := make([]byte, binary.BigEndian.Uint32(size[:]))
	if _, err := io.ReadFull(conn, body); err != nil {
		return nil, err
	}
	if len(body) < 4 || int32(binary.BigEndian.Uint32(body)) != corr {
		return nil, fmt.Errorf("kafkatest: %T: bad response header", req)
	}
	resp := req.ResponseKind()
	resp.SetVersion(req.GetVersion())
	if err := resp.ReadFrom(body[4:]); err != nil {
		return nil, fmt.Errorf("kafkatest: decode %T: %w", resp, err)
	}
	return resp, nil
}
