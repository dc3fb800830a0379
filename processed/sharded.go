package processed

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
	"github.com/idemq/idemq/consumer/dedup"
)

// shardMapSuffix names the table that records a shard's map (migration
// 0006).
const shardMapSuffix = "_shard_map"

// ShardMap says which shard each message belongs to: its shard key (Key),
// then the shard of that key (Place).
//
// Every process consuming through the same shards must use the same map.
// Sharded records it on each shard and refuses a different one, so that a
// change is made on purpose, as a reshard (ShardedConfig.Previous).
type ShardMap struct {
	// Name names Key and Place in the record on each shard: a change to
	// either must come with a new Name. Required when Key or Place is
	// set; "key" otherwise. At most 100 bytes, without "/". A reshard
	// changes Place or Shards, not the keys: Key must give each message
	// the same key under both maps, and Route refuses a message whose key
	// changes while the reshard is under way.
	Name string
	// Shards is the number of shards the map routes to: the first Shards
	// stores of the Sharded. Required.
	Shards int
	// Key returns a message's shard key: a tenant from a header, say.
	// Nil uses the message's ordering key (Message.Key, or what
	// consumer.Config.OrderingKey made it). A message whose key is empty,
	// or for which Key returns an error, is dead-lettered as
	// consumer.ClassUnroutable. A key's messages keep their order only if
	// they share a shard, so derive the shard key from the ordering key
	// (or make them equal).
	Key func(*consumer.Message) (string, error)
	// Place returns the shard of a shard key, from 0 to Shards-1: a
	// tenant's own database, say. Nil hashes the key (FNV-1a, 64 bits) and
	// places the hash with jump consistent hashing, so that going from N
	// to N+1 shards moves 1/(N+1) of the keys, and no key moves between
	// two shards that both stay.
	Place func(key string) (int, error)
}

// id is the map as recorded on the shards: its name and shard count.
func (m ShardMap) id() string { return m.Name + "/" + strconv.Itoa(m.Shards) }

func (m ShardMap) withDefaults() ShardMap {
	if m.Name == "" && m.Key == nil && m.Place == nil {
		m.Name = "key"
	}
	return m
}

func (m ShardMap) validate(field string) error {
	switch {
	case m.Shards < 1:
		return &consumer.ConfigError{Field: field + ".Shards", Reason: fmt.Sprintf("%d: a map routes to one shard or more", m.Shards)}
	case m.Name == "":
		return &consumer.ConfigError{Field: field + ".Name", Reason: "required with Key or Place: it names them in the map recorded on each shard"}
	case len(m.Name) > 100 || strings.ContainsAny(m.Name, "/\x00"):
		return &consumer.ConfigError{Field: field + ".Name", Reason: fmt.Sprintf("%q: at most 100 bytes, without / or NUL", m.Name)}
	}
	return nil
}

// route returns msg's shard under m, and its shard key.
func (m ShardMap) route(msg *consumer.Message) (int, string, error) {
	key := msg.Key
	if m.Key != nil {
		k, err := callMap(m, "Key", func() (string, error) { return m.Key(msg) })
		if err != nil {
			return 0, "", fmt.Errorf("shard map %s: shard key: %w", m.id(), err)
		}
		key = k
	}
	if key == "" {
		if m.Key == nil {
			return 0, "", fmt.Errorf("shard map %s: the message has no ordering key (Message.Key), which the map routes by", m.id())
		}
		return 0, "", fmt.Errorf("shard map %s: the shard key is empty", m.id())
	}
	n, err := m.place(key)
	return n, key, err
}

// place returns the shard of a shard key under m.
func (m ShardMap) place(key string) (int, error) {
	if m.Place == nil {
		h := fnv.New64a()
		_, _ = h.Write([]byte(key))
		return jumpHash(h.Sum64(), m.Shards), nil
	}
	n, err := callMap(m, "Place", func() (int, error) { return m.Place(key) })
	switch {
	case err != nil:
		return 0, fmt.Errorf("shard map %s: place shard key %q: %w", m.id(), key, err)
	case n < 0 || n >= m.Shards:
		return 0, fmt.Errorf("shard map %s: Place put shard key %q on shard %d, outside 0..%d", m.id(), key, n, m.Shards-1)
	}
	return n, nil
}

// callMap calls one of m's functions, turning a panic into an error.
func callMap[T any](m ShardMap, name string, f func() (T, error)) (v T, err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("shard map %s: %s panicked: %v", m.id(), name, p)
		}
	}()
	return f()
}

// jumpHash is Lamping and Veach's jump consistent hash: the bucket of key
// among n.
func jumpHash(key uint64, n int) int {
	b, j := int64(-1), int64(0)
	for j < int64(n) {
		b = j
		key = key*2862933555777941757 + 1
		j = int64(float64(b+1) * (float64(int64(1)<<31) / float64((key>>33)+1)))
	}
	return int(b)
}

// ShardedConfig configures a Sharded.
type ShardedConfig struct {
	// Map routes the messages. Required (Map.Shards at least).
	Map ShardMap
	// Previous is the map before a reshard, set while the reshard is under
	// way; nil otherwise. A message's claim then goes to its shard under
	// Map, after a check of its shard under Previous: a message applied
	// there before the reshard is a duplicate, never applied again. Stop
	// every consumer of the old map before starting one with Previous:
	// the shards record the reshard, and refuse a store of the old map
	// from then on.
	Previous *ShardMap
}

// ErrShardMapChanged is wrapped by the error of a Sharded whose map is not
// the one its shards record, or whose shards disagree.
var ErrShardMapChanged = errors.New("processed: the shard map is not the one the shards record")

// shardMapError is a refused shard map: a configuration error (the runtime
// stops on it) and ErrShardMapChanged.
type shardMapError struct{ reason string }

func (e *shardMapError) Error() string { return ErrShardMapChanged.Error() + ": " + e.reason }

func (e *shardMapError) Unwrap() []error {
	return []error{ErrShardMapChanged, consumer.ErrInvalidConfig}
}

// Sharded is a dedup store over several databases, each a Store with the
// same schema and table: a consumer.ShardedStore. Each message's claim
// goes to the shard its ShardMap picks, in the transaction the handler's
// effect commits in, so a handler writes its effect to that shard's
// database (through the transaction it is given, as always). Purges,
// upkeep and pings run on every shard; the janitor's reports are kept on
// shard 0.
type Sharded struct {
	stores []*Store
	cur    ShardMap
	prev   *ShardMap
	owned  bool // OpenSharded made the stores: Close closes them

	// checked is set once check has passed; checkMu serialises checks.
	checkMu sync.Mutex
	checked atomic.Bool
	// shardChecked[i] is set once shard i alone has passed checkShard
	// while check could not read another shard.
	shardChecked []atomic.Bool
}

// Sharded is a consumer.ShardedStore, with the Store's optional methods.
var _ interface {
	consumer.ShardedStore
	Maintain(ctx context.Context) error
	RecordRetention(ctx context.Context, r dedup.RetentionReport) error
	Durability(ctx context.Context) (dedup.Durability, error)
} = (*Sharded)(nil)

// NewSharded returns a store over shards, shard i being shards[i]. Without
// Previous there are Map.Shards of them; during a reshard, as many as the
// larger map has. The caller keeps owning the stores: Close does not close
// them. NewSharded does not touch the databases: the maps are checked
// against the shards' records by Migrate, and by the first claim.
func NewSharded(shards []*Store, cfg ShardedConfig) (*Sharded, error) {
	cur := cfg.Map.withDefaults()
	if err := cur.validate("Map"); err != nil {
		return nil, err
	}
	want := cur.Shards
	var prev *ShardMap
	if cfg.Previous != nil {
		p := cfg.Previous.withDefaults()
		if err := p.validate("Previous"); err != nil {
			return nil, err
		}
		if p.id() == cur.id() {
			return nil, &consumer.ConfigError{Field: "Previous", Reason: fmt.Sprintf("the same map as Map (%s): a reshard changes the name or the shard count", cur.id())}
		}
		prev, want = &p, max(want, p.Shards)
	}
	if len(shards) != want {
		return nil, &consumer.ConfigError{Field: "shards", Reason: fmt.Sprintf("%d stores for a map of %d shards (the larger map's count during a reshard)", len(shards), want)}
	}
	for i, st := range shards {
		if st == nil {
			return nil, &consumer.ConfigError{Field: "shards", Reason: fmt.Sprintf("shard %d is nil", i)}
		}
	}
	return &Sharded{stores: append([]*Store(nil), shards...), cur: cur, prev: prev, shardChecked: make([]atomic.Bool, len(shards))}, nil
}

// OpenSharded opens a Store on each of databaseURLs, shard i on the i-th,
// each with cfg, and returns the store over them, which Close closes.
func OpenSharded(ctx context.Context, databaseURLs []string, cfg Config, sc ShardedConfig) (*Sharded, error) {
	stores := make([]*Store, 0, len(databaseURLs))
	closeAll := func() {
		for _, st := range stores {
			st.Close()
		}
	}
	for i, u := range databaseURLs {
		st, err := Open(ctx, u, cfg)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("processed: open shard %d: %w", i, err)
		}
		stores = append(stores, st)
	}
	s, err := NewSharded(stores, sc)
	if err != nil {
		closeAll()
		return nil, err
	}
	s.owned = true
	return s, nil
}

// Shards returns the number of shards.
func (s *Sharded) Shards() int { return len(s.stores) }

// Shard returns shard i's store: for its pool, lookups and stats.
func (s *Sharded) Shard(i int) *Store { return s.stores[i] }

// String names the shards.
func (s *Sharded) String() string {
	names := make([]string, len(s.stores))
	for i, st := range s.stores {
		names[i] = st.String()
	}
	return fmt.Sprintf("sharded(%s: %s)", s.cur.id(), strings.Join(names, ", "))
}

// Route returns msg's shard, and during a reshard its shard before it.
func (s *Sharded) Route(msg *consumer.Message) (dedup.Route, error) {
	n, key, err := s.cur.route(msg)
	if err != nil {
		return dedup.Route{}, err
	}
	r := dedup.Route{Shard: n, Was: n, Key: key}
	if s.prev != nil {
		var was string
		if r.Was, was, err = s.prev.route(msg); err != nil {
			return dedup.Route{}, fmt.Errorf("during the reshard from %s: %w", s.prev.id(), err)
		}
		if was != key {
			// Its row, if it was applied, is under the old key: a
			// claim under the new one would not find it, and MoveRows
			// places rows by the key they were claimed with.
			return dedup.Route{}, fmt.Errorf("during the reshard from %s to %s the message's shard key changes from %q to %q: a reshard changes where keys go (Place, Shards), not the keys (Key)",
				s.prev.id(), s.cur.id(), was, key)
		}
	}
	return r, nil
}

// BeginClaim begins a transaction on the claims' shard and claims them
// there; all must have the same Route.Shard. During a reshard, a claim
// whose message was on another shard before is checked there first: if it
// was applied there, it is a duplicate (or a mismatch), and the row this
// transaction records for it on the new shard is the old row's copy.
func (s *Sharded) BeginClaim(ctx context.Context, claims []dedup.Claim) (pgx.Tx, []dedup.ClaimResult, error) {
	if len(claims) == 0 {
		return nil, nil, errors.New("processed: BeginClaim with no claims")
	}
	shard := claims[0].Route.Shard
	for _, c := range claims {
		if c.Route.Shard != shard {
			return nil, nil, fmt.Errorf("processed: claims of shards %d and %d in one transaction", shard, c.Route.Shard)
		}
		if c.Route.Shard < 0 || c.Route.Shard >= len(s.stores) || c.Route.Was < 0 || c.Route.Was >= len(s.stores) {
			return nil, nil, fmt.Errorf("processed: a claim routed to shard %d (before the reshard %d), outside the %d shards", c.Route.Shard, c.Route.Was, len(s.stores))
		}
	}
	if err := s.checkShard(ctx, shard); err != nil {
		return nil, nil, err
	}
	// The rows of moved messages on their old shards. No claim goes to
	// an old shard for them any more (every store of the old map was
	// refused once the reshard was recorded), so these reads are stable.
	var before map[int]Row
	orig := claims
	if s.prev != nil {
		var err error
		if before, err = s.movedRows(ctx, claims); err != nil {
			return nil, nil, err
		}
		if len(before) > 0 {
			claims = append([]dedup.Claim(nil), orig...)
			for i, row := range before {
				copy(claims[i].Fingerprint[:], row.Fingerprint)
			}
		}
	}
	tx, res, err := s.stores[shard].BeginClaim(ctx, claims)
	if err != nil {
		return tx, res, err
	}
	for i, row := range before {
		res[i] = dedup.ClaimResult{Outcome: dedup.ClaimDuplicate, ProcessedAt: row.ProcessedAt}
		if !bytes.Equal(row.Fingerprint, orig[i].Fingerprint[:]) {
			res[i].Outcome = dedup.ClaimMismatch
		}
	}
	return tx, res, nil
}

// movedRows reads, on their old shards, the rows of the claims whose
// messages moved, by the claims' index.
func (s *Sharded) movedRows(ctx context.Context, claims []dedup.Claim) (map[int]Row, error) {
	byShard := map[int][]int{}
	for i, c := range claims {
		if c.Route.Was != c.Route.Shard {
			byShard[c.Route.Was] = append(byShard[c.Route.Was], i)
		}
	}
	var out map[int]Row
	for was, idx := range byShard {
		st := s.stores[was]
		stm, err := st.statements(ctx)
		if err != nil {
			return nil, fmt.Errorf("processed: reshard: shard %d: %w", was, err)
		}
		var b pgx.Batch
		for _, i := range idx {
			if stm.keyed {
				b.Queue(stm.lookupKey, claims[i].Consumer, claims[i].MessageID, claims[i].Route.Key)
			} else {
				b.Queue(stm.lookup, claims[i].Consumer, claims[i].MessageID)
			}
		}
		br := st.db.SendBatch(ctx, &b)
		for _, i := range idx {
			var r Row
			err := br.QueryRow().Scan(&r.Consumer, &r.MessageID, &r.Fingerprint, &r.ProcessedAt, &r.Source, &r.Partition, &r.Offset)
			switch {
			case errors.Is(err, pgx.ErrNoRows):
				continue
			case err != nil:
				_ = br.Close()
				return nil, st.wrap(fmt.Sprintf("reshard: look up moved claims on shard %d", was), err)
			}
			if out == nil {
				out = map[int]Row{}
			}
			out[i] = r
		}
		if err := br.Close(); err != nil {
			return nil, st.wrap(fmt.Sprintf("reshard: look up moved claims on shard %d", was), err)
		}
	}
	return out, nil
}

// recorded is one shard's record of its map.
type recorded struct {
	present     bool
	shard       int
	mapID       string
	previous    *string
	movingSince *time.Time
	// complete is false while a first use is recording the map shard by
	// shard (migration 0008): until every shard holds a record.
	complete bool
}

func (r recorded) String() string {
	switch {
	case !r.present:
		return "no map"
	case r.previous != nil:
		return fmt.Sprintf("shard %d of a reshard from %s to %s", r.shard, *r.previous, r.mapID)
	case !r.complete:
		return fmt.Sprintf("shard %d of %s (its first use not yet recorded on every shard)", r.shard, r.mapID)
	}
	return fmt.Sprintf("shard %d of %s", r.shard, r.mapID)
}

// readRecord reads shard i's record.
func (s *Sharded) readRecord(ctx context.Context, i int) (recorded, error) {
	st := s.stores[i]
	stm, err := st.statements(ctx)
	if err != nil {
		return recorded{}, err
	}
	var r recorded
	err = st.db.QueryRow(ctx, "SELECT shard, map, previous, moving_since, complete FROM "+stm.shardMap).Scan(&r.shard, &r.mapID, &r.previous, &r.movingSince, &r.complete)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return recorded{}, nil
	case err != nil:
		return recorded{}, st.wrap(fmt.Sprintf("read the shard map of shard %d", i), err)
	}
	r.present = true
	return r, nil
}

// readRecords reads every shard's record, and counts those present and
// those complete.
func (s *Sharded) readRecords(ctx context.Context) (recs []recorded, present, complete int, err error) {
	recs = make([]recorded, len(s.stores))
	for i := range s.stores {
		if recs[i], err = s.readRecord(ctx, i); err != nil {
			return nil, 0, 0, err
		}
		if recs[i].present {
			present++
			if recs[i].complete {
				complete++
			}
		}
	}
	return recs, present, complete, nil
}

// check compares the configured maps with the shards' records, once it has
// passed; it records the map on shards of a first use, and the reshard on
// every shard when it begins.
func (s *Sharded) check(ctx context.Context) error {
	if s.checked.Load() {
		return nil
	}
	s.checkMu.Lock()
	defer s.checkMu.Unlock()
	if s.checked.Load() {
		return nil
	}
	recs, present, complete, err := s.readRecords(ctx)
	if err == nil && complete > 0 && present < len(recs) {
		// The shards are read one by one: one read without a record
		// before another process completed the map, whose complete
		// record was read next, is read again. A complete record means
		// every shard held one before it was read, so a shard that has
		// none on the second reading lost it.
		recs, present, complete, err = s.readRecords(ctx)
	}
	if err != nil {
		return err
	}
	refuse := func(format string, args ...any) error {
		return &shardMapError{reason: fmt.Sprintf(format, args...)}
	}
	cur := s.cur.id()
	for i, r := range recs {
		if r.present && r.shard != i {
			return refuse("database %d of the store records that it is shard %d (%s): the databases are in another order than when the map was recorded", i, r.shard, s.stores[i])
		}
	}
	replaced := func(i int) error {
		return refuse("shard %d (%s) records no map while the others do: was its database replaced? Its dedup rows would be gone", i, s.stores[i])
	}
	// write records the map, or the reshard, on shard i.
	var write func(tx pgx.Tx, i int, st *statements) error
	if s.prev == nil {
		for i, r := range recs {
			switch {
			case !r.present && complete > 0:
				return replaced(i)
			case r.present && r.previous != nil && r.mapID == cur:
				return refuse("a reshard from %s to %s is under way (since %s): keep ShardedConfig.Previous set to the old map until it is finished", *r.previous, cur, r.movingSince.Format(time.RFC3339))
			case r.present && r.mapID != cur:
				return refuse("shard %d records %s, and the configured map is %s: changing the map is a reshard; set ShardedConfig.Previous to the recorded map", i, r, cur)
			case r.present && r.previous != nil:
				return refuse("shard %d records %s, not %s", i, r, cur)
			}
		}
		if complete == len(recs) {
			s.checked.Store(true)
			return nil
		}
		// A first use, or one under way in another process, or one a
		// crash interrupted: record the map where it is missing, and
		// once every shard holds it, mark it complete.
		write = func(tx pgx.Tx, i int, st *statements) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+st.shardMap+" (shard, map, complete) VALUES ($1, $2, false) ON CONFLICT DO NOTHING", i, cur)
			return err
		}
	} else {
		prev := s.prev.id()
		finished := 0 // FinishReshard ran: checking the old shards too is harmless
		for _, r := range recs {
			if r.present && r.previous == nil && r.mapID == cur {
				finished++
			}
		}
		for i, r := range recs {
			switch {
			case !r.present && i >= s.cur.Shards && finished > 0:
				// A shard the finished reshard left: FinishReshard
				// deleted its record.
			case !r.present && i < s.cur.Shards && finished > 0,
				!r.present && i < s.prev.Shards && complete > 0:
				return replaced(i)
			case !r.present && i < s.prev.Shards && present > 0:
				return refuse("shard %d (%s) records no map, and the others record %s's first use as under way: start a process of that map to finish it, then the reshard", i, s.stores[i], prev)
			case !r.present:
			case r.previous == nil && r.mapID == prev:
			case r.previous != nil && *r.previous == prev && r.mapID == cur:
			case r.previous == nil && r.mapID == cur:
			default:
				return refuse("shard %d records %s; the configured reshard is from %s to %s", i, r, prev, cur)
			}
		}
		if finished > 0 {
			if finished != s.cur.Shards || present != finished {
				return refuse("the shards record a reshard from %s to %s as finished on %d of them", prev, cur, finished)
			}
			s.checked.Store(true)
			return nil
		}
		write = func(tx pgx.Tx, i int, st *statements) error {
			_, err := tx.Exec(ctx, `INSERT INTO `+st.shardMap+` (shard, map, previous, moving_since) VALUES ($1, $2, $3, now())
ON CONFLICT (one) DO UPDATE SET map = EXCLUDED.map, previous = EXCLUDED.previous,
    moving_since = coalesce(`+st.shardMap+`.moving_since, EXCLUDED.moving_since), recorded_at = now()
WHERE `+st.shardMap+`.map = $4 AND `+st.shardMap+`.previous IS NULL`, i, cur, prev, prev)
			return err
		}
	}
	// Record on each shard, then read back: a process that raced this one
	// with another map finds its record and is refused.
	onEach := func(what string, f func(tx pgx.Tx, i int, st *statements) error) error {
		for i, st := range s.stores {
			stm, err := st.statements(ctx)
			if err != nil {
				return err
			}
			if err := pgx.BeginFunc(ctx, st.db, func(tx pgx.Tx) error { return f(tx, i, stm) }); err != nil {
				return st.wrap(fmt.Sprintf("%s on shard %d", what, i), err)
			}
		}
		return nil
	}
	if err := onEach("record the shard map", write); err != nil {
		return err
	}
	for i := range s.stores {
		r, err := s.readRecord(ctx, i)
		if err != nil {
			return err
		}
		wantPrev := s.prev != nil
		if s.prev != nil && i >= s.cur.Shards && !r.present {
			continue // a shard the map leaves (not recorded: not written to)
		}
		if !r.present || r.shard != i || r.mapID != cur || (r.previous != nil) != wantPrev {
			return refuse("shard %d records %s after this store recorded its map: another process records another", i, r)
		}
	}
	// Every shard of the map holds the record: mark it complete (a
	// reshard over a first use that was cut short completes it too).
	if err := onEach("mark the shard map complete", func(tx pgx.Tx, _ int, st *statements) error {
		_, err := tx.Exec(ctx, "UPDATE "+st.shardMap+" SET complete = true, recorded_at = now() WHERE map = $1 AND NOT complete", cur)
		return err
	}); err != nil {
		return err
	}
	s.checked.Store(true)
	return nil
}

// checkShard is check, for a claim on shard i. When check cannot read
// another shard (it does not answer), and no reshard is configured, shard
// i may be claimed on if it records this map, as shard i, itself: so a
// process that starts while a shard is down applies the other shards'
// messages. A refusal, a table not migrated and a configuration error
// stop every claim, as check's do, and so does a reshard: its records
// must be read on every shard.
func (s *Sharded) checkShard(ctx context.Context, i int) error {
	if s.shardChecked[i].Load() {
		return nil // and not check again: it would wait on the shard that is down
	}
	err := s.check(ctx)
	var refused *shardMapError
	if err == nil || s.prev != nil || errors.As(err, &refused) ||
		errors.Is(err, consumer.ErrNotMigrated) || errors.Is(err, consumer.ErrInvalidConfig) {
		return err
	}
	r, rerr := s.readRecord(ctx, i)
	if rerr != nil {
		return rerr
	}
	if !r.present || !r.complete || r.shard != i || r.mapID != s.cur.id() || r.previous != nil {
		return err
	}
	s.shardChecked[i].Store(true)
	return nil
}

// ErrReshardUnfinished is wrapped by FinishReshard's error while a shard
// still holds dedup rows from before the reshard that the new map places
// elsewhere, or that have no shard key.
var ErrReshardUnfinished = errors.New("processed: the reshard cannot finish yet")

// FinishReshard ends the reshard this store is configured for, once the
// old map has nothing left to say: no shard holds a dedup row from before
// the reshard that the new map places on another shard (MoveRows moves
// them), or that has no shard key (those age out through the janitor's
// purges). Until then it returns an error wrapping ErrReshardUnfinished
// that counts them per shard. It reads every row from before the reshard.
// Afterwards the shards record Map alone: start the consumers without
// Previous (a store that still has it keeps working). Shards the new map
// leaves are forgotten: their records are deleted.
func (s *Sharded) FinishReshard(ctx context.Context) error {
	if s.prev == nil {
		return &consumer.ConfigError{Field: "Previous", Reason: "FinishReshard needs the reshard's old map"}
	}
	if err := s.check(ctx); err != nil {
		return err
	}
	var since time.Time
	for i := range s.stores {
		r, err := s.readRecord(ctx, i)
		if err != nil {
			return err
		}
		if r.movingSince != nil && (since.IsZero() || r.movingSince.Before(since)) {
			since = *r.movingSince
		}
	}
	if since.IsZero() {
		return nil // finished already
	}
	var left []string
	for i, st := range s.stores {
		rep, err := s.misplaced(ctx, i, st, since)
		if err != nil {
			return fmt.Errorf("processed: finish the reshard: shard %d: %w", i, err)
		}
		if rep.Misplaced > 0 || rep.Unkeyed > 0 {
			left = append(left, fmt.Sprintf("shard %d holds %d rows from before it that the map places on another shard (MoveRows moves them) and %d without a shard key (purged once older than the retention)",
				i, rep.Misplaced, rep.Unkeyed))
		}
	}
	if len(left) > 0 {
		return fmt.Errorf("%w: it began %s, and %s", ErrReshardUnfinished, since.UTC().Format(time.RFC3339), strings.Join(left, "; "))
	}
	cur, prev := s.cur.id(), s.prev.id()
	for i, st := range s.stores {
		stm, err := st.statements(ctx)
		if err != nil {
			return err
		}
		q := "UPDATE " + stm.shardMap + " SET previous = NULL, moving_since = NULL, recorded_at = now() WHERE map = $1 AND previous = $2"
		if i >= s.cur.Shards {
			q = "DELETE FROM " + stm.shardMap + " WHERE map = $1 AND previous = $2"
		}
		if _, err := st.db.Exec(ctx, q, cur, prev); err != nil {
			return st.wrap(fmt.Sprintf("finish the reshard on shard %d", i), err)
		}
	}
	return nil
}

// misplaced counts shard i's rows from before since that the map places
// on another shard, and those without a shard key.
func (s *Sharded) misplaced(ctx context.Context, i int, st *Store, since time.Time) (MoveReport, error) {
	var rep MoveReport
	err := s.scanPlaced(ctx, st, since, &rep, func(_ []movedRow, shards []int) error {
		for _, n := range shards {
			if n != i {
				rep.Misplaced++
			}
		}
		return nil
	})
	return rep, err
}

// Migrate migrates every shard, then checks the maps against the shards'
// records, recording them on a first use and when a reshard begins.
func (s *Sharded) Migrate(ctx context.Context) error {
	for i, st := range s.stores {
		if err := st.Migrate(ctx); err != nil {
			return fmt.Errorf("processed: migrate shard %d: %w", i, err)
		}
	}
	return s.check(ctx)
}

// eachShard runs f on every shard, and joins their errors, each naming its
// shard.
func (s *Sharded) eachShard(f func(i int, st *Store) error) error {
	var errs []error
	for i, st := range s.stores {
		if err := f(i, st); err != nil {
			errs = append(errs, fmt.Errorf("shard %d: %w", i, err))
		}
	}
	return errors.Join(errs...)
}

// Lookup returns the row for consumerName and id from the shard that
// holds it, or an error wrapping ErrNotFound: each shard is asked in turn,
// as the id alone does not say which shard its message went to. It makes a
// Sharded the Store of package dlq's classification and replay.
func (s *Sharded) Lookup(ctx context.Context, consumerName, id string) (Row, error) {
	return s.askShards(func(st *Store) (Row, error) { return st.Lookup(ctx, consumerName, id) },
		func() error {
			return fmt.Errorf("%w: consumer %q, message id %q on any of %s", ErrNotFound, consumerName, id, s)
		})
}

// LookupMessage returns the row of msg (a dead letter, say) for
// consumerName and id, from the shard that holds it: Lookup's row, except
// on tables that keep the shard key in their primary key
// (Config.ShardKeyInPrimaryKey), where an id has a row under each key it
// was applied with, and msg's own is the one of its shard key by the map
// (or, during a reshard, by the map before it). A message the maps give no
// shard key has no row there: ErrNotFound. Package dlq looks dead letters
// up with it, so that another key's row of the same id is not taken for
// theirs.
func (s *Sharded) LookupMessage(ctx context.Context, consumerName, id string, msg *consumer.Message) (Row, error) {
	var keys []string
	for _, m := range []*ShardMap{&s.cur, s.prev} {
		if m == nil {
			continue
		}
		if _, key, err := m.route(msg); err == nil && !slices.Contains(keys, key) {
			keys = append(keys, key)
		}
	}
	notFound := func() error {
		return fmt.Errorf("%w: consumer %q, message id %q with shard key %q on any of %s", ErrNotFound, consumerName, id, strings.Join(keys, `" or "`), s)
	}
	return s.askShards(func(st *Store) (Row, error) {
		stm, err := st.statements(ctx)
		if err != nil {
			return Row{}, err
		}
		if !stm.keyed {
			return st.Lookup(ctx, consumerName, id) // an id has one row
		}
		for _, key := range keys {
			if r, err := st.lookupWith(ctx, stm.lookupKey, consumerName, id, key); !errors.Is(err, ErrNotFound) {
				return r, err
			}
		}
		return Row{}, notFound()
	}, notFound)
}

// askShards returns the first row ask finds, asking each shard in turn;
// ask's error wraps ErrNotFound on a shard without it. When no shard has
// it, the others' errors, each naming its shard, or notFound's.
func (s *Sharded) askShards(ask func(st *Store) (Row, error), notFound func() error) (Row, error) {
	var errs []error
	for i, st := range s.stores {
		r, err := ask(st)
		switch {
		case err == nil:
			return r, nil
		case !errors.Is(err, ErrNotFound):
			errs = append(errs, fmt.Errorf("shard %d: %w", i, err))
		}
	}
	if len(errs) > 0 {
		return Row{}, errors.Join(errs...)
	}
	return Row{}, notFound()
}

// PingShard pings shard i.
func (s *Sharded) PingShard(ctx context.Context, i int) error {
	if i < 0 || i >= len(s.stores) {
		return fmt.Errorf("processed: ping shard %d of %d", i, len(s.stores))
	}
	return s.stores[i].Ping(ctx)
}

// Ping pings every shard.
func (s *Sharded) Ping(ctx context.Context) error {
	return s.eachShard(func(_ int, st *Store) error { return st.Ping(ctx) })
}

// Purge purges consumerName's rows on every shard, and returns how many.
func (s *Sharded) Purge(ctx context.Context, consumerName string, olderThan time.Duration) (int64, error) {
	var total int64
	err := s.eachShard(func(_ int, st *Store) error {
		n, err := st.Purge(ctx, consumerName, olderThan)
		total += n
		return err
	})
	return total, err
}

// MaxConns returns the smallest of the shards' pool sizes: the runtime
// uses as many connections on each.
func (s *Sharded) MaxConns() int {
	n := s.stores[0].MaxConns()
	for _, st := range s.stores[1:] {
		n = min(n, st.MaxConns())
	}
	return n
}

// Maintain runs each shard's upkeep.
func (s *Sharded) Maintain(ctx context.Context) error {
	return s.eachShard(func(_ int, st *Store) error { return st.Maintain(ctx) })
}

// RecordRetention records the janitor's report on shard 0: it is the
// consumer's, over all its shards.
func (s *Sharded) RecordRetention(ctx context.Context, r dedup.RetentionReport) error {
	return s.stores[0].RecordRetention(ctx, r)
}

// Durability returns the weakest shard's: a standby before any primary,
// then the fewest nodes, then the most warnings.
func (s *Sharded) Durability(ctx context.Context) (dedup.Durability, error) {
	var (
		weakest dedup.Durability
		found   bool
	)
	err := s.eachShard(func(_ int, st *Store) error {
		d, err := st.Durability(ctx)
		if err != nil {
			return err
		}
		switch {
		case !found, d.Standby && !weakest.Standby,
			d.Standby == weakest.Standby && (d.Nodes < weakest.Nodes || d.Nodes == weakest.Nodes && len(d.Warnings()) > len(weakest.Warnings())):
			weakest, found = d, true
		}
		return nil
	})
	return weakest, err
}

// Close closes the stores if OpenSharded made them.
func (s *Sharded) Close() {
	if !s.owned {
		return
	}
	for _, st := range s.stores {
		st.Close()
	}
}
