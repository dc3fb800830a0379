package consumer

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/idemq/idemq/consumer/dedup"
)

// ShardedStore is a Store over several databases, the shards: each message
// belongs to one, by a shard key of its own, and its claim and its
// handler's effect commit there together, in one transaction, as with a
// store of one database. processed.Sharded is one.
//
// With a ShardedStore the runtime asks Route for each message's shard as
// it receives it, and groups only messages of one shard in a transaction:
// each shard has Concurrency lanes of its own. A message Route finds no
// shard for is dead-lettered as ClassUnroutable, with Route's error, and
// never claimed anywhere. BeginClaim receives claims of one shard at a time,
// each with its Route.
type ShardedStore interface {
	dedup.Store
	// Shards is how many shards the runtime routes to: Route returns a
	// Shard below it. It must not change while the store is in use.
	Shards() int
	// Route returns msg's shard, or an error if it has none. It is called
	// once per delivery, on the runtime's receive path: keep it cheap.
	Route(msg *Message) (dedup.Route, error)
	// PingShard is Ping for one shard: the runtime asks the shard of a
	// transaction whose connection died, to tell a message that costs its
	// connection from a database that is down, without another shard's
	// outage deciding it.
	PingShard(ctx context.Context, shard int) error
}

// errRoutePanicked is the error of a Route that panicked.
var errRoutePanicked = errors.New("the shard map's Route panicked")

// routeMessage sets msg's route from the ShardedStore, if the Store is
// one, turning a panic or a shard out of range into the message's error.
func (r *Runtime) routeMessage(msg *Message) {
	if r.router == nil {
		return
	}
	msg.route, msg.routeErr = dedup.Route{}, nil
	func() {
		defer func() {
			if v := recover(); v != nil {
				msg.routeErr = fmt.Errorf("%w: %v", errRoutePanicked, v)
				r.log.Error("idemq: the shard map's Route panicked", "panic", fmt.Sprint(v), "stack", string(debug.Stack()))
			}
		}()
		msg.route, msg.routeErr = r.router.Route(msg)
	}()
	if msg.routeErr == nil {
		n := r.shards
		if rt := msg.route; rt.Shard < 0 || rt.Shard >= n || rt.Was < 0 || rt.Was >= n {
			msg.routeErr = fmt.Errorf("the shard map routed the message to shard %d (before the reshard %d), outside the store's %d shards", rt.Shard, rt.Was, n)
		}
	}
	if msg.routeErr != nil {
		msg.route = dedup.Route{}
	}
}
