package kafkatest_test

import (
	"net"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/idemq/idemq/internal/kafkatest"
)

// The group protocol driven by hand, with the versions kafka-go uses (a
// JoinGroup below v4 joins at once, without MEMBER_ID_REQUIRED), so that a
// test can drop a member's connection while its JoinGroup is parked.
const (
	testSession   = 300 * time.Millisecond
	testRebalance = time.Second
)

type groupEnv struct {
	t     *testing.T
	addr  string
	c     *kfake.Cluster
	topic string
	group string

	mu    sync.Mutex
	conns []net.Conn
}

func newGroupEnv(t *testing.T, c *kfake.Cluster) *groupEnv {
	e := &groupEnv{t: t, addr: c.ListenAddrs()[0], c: c, topic: kafkatest.Name(t, "t"), group: kafkatest.Name(t, "g")}
	if err := c.CreateTopic(e.topic, 2, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		for _, conn := range e.conns {
			_ = conn.Close()
		}
	})
	return e
}

func (e *groupEnv) dial() net.Conn {
	conn, err := net.Dial("tcp", e.addr)
	if err != nil {
		e.t.Fatal(err)
	}
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	e.mu.Lock()
	e.conns = append(e.conns, conn)
	e.mu.Unlock()
	return conn
}

func (e *groupEnv) joinReq(memberID string) *kmsg.JoinGroupRequest {
	req := kmsg.NewPtrJoinGroupRequest()
	req.SetVersion(3)
	req.Group, req.MemberID, req.ProtocolType = e.group, memberID, "consumer"
	req.SessionTimeoutMillis = int32(testSession / time.Millisecond)
	req.RebalanceTimeoutMillis = int32(testRebalance / time.Millisecond)
	meta := kmsg.NewConsumerMemberMetadata()
	meta.Topics = []string{e.topic}
	p := kmsg.NewJoinGroupRequestProtocol()
	p.Name, p.Metadata = "range", meta.AppendTo(nil)
	req.Protocols = append(req.Protocols, p)
	return req
}

// joinAsync sends a JoinGroup on its own connection; the response arrives
// on the returned channel (nil if the connection was dropped first).
func (e *groupEnv) joinAsync(memberID, clientID string) (net.Conn, <-chan *kmsg.JoinGroupResponse) {
	conn := e.dial()
	ch := make(chan *kmsg.JoinGroupResponse, 1)
	go func() {
		resp, err := kafkatest.RoundTripOn(conn, e.joinReq(memberID), clientID)
		if err != nil {
			ch <- nil
			return
		}
		ch <- resp.(*kmsg.JoinGroupResponse)
	}()
	return conn, ch
}

func (e *groupEnv) join(memberID, clientID string) *kmsg.JoinGroupResponse {
	_, ch := e.joinAsync(memberID, clientID)
	resp := <-ch
	if resp == nil || resp.ErrorCode != 0 {
		e.t.Fatalf("join %q: %+v", memberID, resp)
	}
	return resp
}

// sync syncs as leader with assign (member id -> partitions of the topic).
func (e *groupEnv) sync(gen int32, memberID string, assign map[string][]int32) {
	req := kmsg.NewPtrSyncGroupRequest()
	req.SetVersion(2)
	req.Group, req.Generation, req.MemberID = e.group, gen, memberID
	for id, parts := range assign {
		a := kmsg.NewConsumerMemberAssignment()
		at := kmsg.NewConsumerMemberAssignmentTopic()
		at.Topic, at.Partitions = e.topic, parts
		a.Topics = append(a.Topics, at)
		ga := kmsg.NewSyncGroupRequestGroupAssignment()
		ga.MemberID, ga.MemberAssignment = id, a.AppendTo(nil)
		req.GroupAssignment = append(req.GroupAssignment, ga)
	}
	resp, err := kafkatest.RoundTripOn(e.dial(), req, "a")
	if err != nil || resp.(*kmsg.SyncGroupResponse).ErrorCode != 0 {
		e.t.Fatalf("sync: %+v, %v", resp, err)
	}
}

func (e *groupEnv) heartbeat(conn net.Conn, gen int32, memberID string) int16 {
	req := kmsg.NewPtrHeartbeatRequest()
	req.SetVersion(2)
	req.Group, req.Generation, req.MemberID = e.group, gen, memberID
	resp, err := kafkatest.RoundTripOn(conn, req, "a")
	if err != nil {
		e.t.Fatalf("heartbeat: %v", err)
	}
	return resp.(*kmsg.HeartbeatResponse).ErrorCode
}

func (e *groupEnv) leave(memberID string) {
	req := kmsg.NewPtrLeaveGroupRequest()
	req.SetVersion(3)
	req.Group = e.group
	m := kmsg.NewLeaveGroupRequestMember()
	m.MemberID = memberID
	req.Members = append(req.Members, m)
	if _, err := kafkatest.RoundTripOn(e.dial(), req, "leave"); err != nil {
		e.t.Fatalf("leave: %v", err)
	}
}

func (e *groupEnv) waitInfo(what string, fn func(*kfake.GroupInfo) bool) *kfake.GroupInfo {
	deadline := time.Now().Add(10 * time.Second)
	for {
		gi := e.c.GroupInfo(e.group)
		if gi != nil && fn(gi) {
			return gi
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("group never %s: %+v", what, gi)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func memberByClient(gi *kfake.GroupInfo, clientID string) (kfake.GroupMember, bool) {
	for _, m := range gi.Members {
		if m.ClientID == clientID {
			return m, true
		}
	}
	return kfake.GroupMember{}, false
}

// killInJoin brings the group to the state the chaos suite met: member a
// leads a stable generation in which member b, killed while its JoinGroup
// was parked, holds partition 1. It returns a's id and generation, and b's
// id.
func (e *groupEnv) killInJoin() (a string, gen int32, b string) {
	r := e.join("", "a")
	a = r.MemberID
	e.sync(r.Generation, a, map[string][]int32{a: {0, 1}})

	connB, bj := e.joinAsync("", "b") // parks: the group waits for a to rejoin
	gi := e.waitInfo("rebalancing with b", func(gi *kfake.GroupInfo) bool {
		_, ok := memberByClient(gi, "b")
		return ok && gi.State == "PreparingRebalance"
	})
	mb, _ := memberByClient(gi, "b")
	b = mb.MemberID
	// b is SIGKILLed in the join barrier: its socket closes. Half-close
	// it and wait for kfake to close its end, so that kfake has seen it.
	if err := connB.(*net.TCPConn).CloseWrite(); err != nil {
		e.t.Fatal(err)
	}
	if r := <-bj; r != nil {
		e.t.Fatalf("b answered before a rejoined: %+v", r)
	}

	r = e.join(a, "a") // completes the rebalance; b's answer goes nowhere
	if r.LeaderID != a || len(r.Members) != 2 {
		e.t.Fatalf("rejoin: leader %q, %d members, want a leading a and b", r.LeaderID, len(r.Members))
	}
	gen = r.Generation
	e.sync(gen, a, map[string][]int32{a: {0}, b: {1}})
	return a, gen, b
}

// TestEdgeMemberKilledInJoinIsEvicted: a member killed while its JoinGroup
// is parked is answered on a dead connection, and kfake (when that answer
// is lost: see rounds) never arms its session timer, so it keeps the
// partition the leader gave it for good:
// nobody reads that partition (the kafka-kills-rebalance stalls in which a
// dead worker held partitions). The cluster kafkatest starts removes it one
// session timeout after the generation starts, as Apache Kafka does.
func TestEdgeMemberKilledInJoinIsEvicted(t *testing.T) {
	t.Run("kfake alone keeps it", func(t *testing.T) {
		c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(kafkatest.MinSessionTimeout))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		e := newGroupEnv(t, c)
		a, gen, b := e.killInJoin()
		hb := e.dial()
		for end := time.Now().Add(4 * (testSession + testRebalance)); time.Now().Before(end); {
			if code := e.heartbeat(hb, gen, a); code != 0 {
				t.Logf("kfake rebalanced by itself (heartbeat error %v): the enforcer may no longer be needed", kerr.ErrorForCode(code))
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		gi := c.GroupInfo(e.group)
		if m, ok := memberByClient(gi, "b"); !ok || m.MemberID != b || !slices.Equal(m.Assignment[e.topic], []int32{1}) {
			t.Logf("kfake no longer keeps the killed member (%+v): the enforcer may no longer be needed", gi)
		}
	})
	t.Run("kafkatest evicts it", func(t *testing.T) {
		c := kafkatest.Start(t)
		for round := range rounds {
			e := newGroupEnv(t, c.Cluster)
			a, gen, b := e.killInJoin()
			start := time.Now()
			hb := e.dial()
			for e.heartbeat(hb, gen, a) != kerr.RebalanceInProgress.Code {
				if time.Since(start) > 10*testSession {
					t.Fatalf("round %d: no rebalance %s after the generation started: the killed member is still in %+v", round, time.Since(start), c.GroupInfo(e.group))
				}
				time.Sleep(50 * time.Millisecond)
			}
			r := e.join(a, "a")
			if len(r.Members) != 1 || r.Members[0].MemberID != a {
				t.Fatalf("round %d: after the eviction the group has %d members, want a alone (b was %s)", round, len(r.Members), b)
			}
			e.sync(r.Generation, a, map[string][]int32{a: {0, 1}})
			if gi := c.GroupInfo(e.group); gi.State != "Stable" || gi.NumAssigned() != 2 {
				t.Fatalf("round %d: group %+v, want a stable generation with both partitions assigned", round, gi)
			}
		}
		t.Logf("%d rounds, %d killed members evicted by the enforcer (the others had a timer)", rounds, c.Sessions.Evicted())
	})
}

// rounds is how many times the enforced tests build the trap: kfake's
// answer to the dead connection is lost only when its select picks the
// closed connection over the buffered response channel, about half the
// time, so one round can miss it.
const rounds = 4

// TestEdgeRebalanceWaitingOnKilledMemberCompletes: the CI stall. The next
// rebalance of a group holding a member killed in its join barrier waits
// for that member to rejoin, and kfake pushes the rebalance deadline back
// at every join and leave: with members joining and leaving more often
// than the rebalance timeout, kfake never completes it, and every live
// member's JoinGroup hangs. With the enforcer the dead member is removed
// and the rebalance completes while the churn goes on.
func TestEdgeRebalanceWaitingOnKilledMemberCompletes(t *testing.T) {
	run := func(t *testing.T, c *kfake.Cluster) (completed bool) {
		e := newGroupEnv(t, c)
		a, _, b := e.killInJoin()
		// At once, before a session timeout: c joins, a rejoins.
		_, cj := e.joinAsync("", "c")
		e.waitInfo("rebalancing with c", func(gi *kfake.GroupInfo) bool {
			_, ok := memberByClient(gi, "c")
			return ok && gi.State == "PreparingRebalance"
		})
		_, aj := e.joinAsync(a, "a")
		// Churn: a member joins and leaves every 400ms, under the
		// rebalance timeout.
		deadline := time.Now().Add(4 * (testSession + testRebalance))
		for i := 0; time.Now().Before(deadline); i++ {
			select {
			case r := <-aj:
				if r == nil || r.ErrorCode != 0 {
					t.Fatalf("a's rejoin: %+v", r)
				}
				for _, m := range r.Members {
					if m.MemberID == b {
						t.Errorf("generation %d still has the killed member", r.Generation)
					}
				}
				<-cj
				return true
			default:
			}
			id := "churn-" + string(rune('a'+i%26))
			conn, _ := e.joinAsync("", id)
			gi := e.waitInfo("joined by "+id, func(gi *kfake.GroupInfo) bool { _, ok := memberByClient(gi, id); return ok })
			m, _ := memberByClient(gi, id)
			time.Sleep(200 * time.Millisecond)
			e.leave(m.MemberID)
			_ = conn.Close()
			time.Sleep(200 * time.Millisecond)
		}
		return false
	}
	t.Run("kfake alone stalls", func(t *testing.T) {
		c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(kafkatest.MinSessionTimeout))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if run(t, c) {
			t.Log("kfake completed the rebalance by itself: the enforcer may no longer be needed")
		}
	})
	t.Run("kafkatest completes it", func(t *testing.T) {
		c := kafkatest.Start(t)
		for round := range rounds {
			if !run(t, c.Cluster) {
				t.Fatalf("round %d: the rebalance did not complete in %s of churn", round, 4*(testSession+testRebalance))
			}
		}
		t.Logf("%d rounds, %d killed members evicted by the enforcer (the others had a timer)", rounds, c.Sessions.Evicted())
	})
}
