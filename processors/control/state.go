package control

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/policy"
)

// Log attribute keys of this package.
const (
	attrSubject  = "subject"
	attrKind     = "kind"
	attrBy       = "by"
	attrByTenant = "by_tenant"
)

// fetchMaxWait bounds how long the broker holds a fetch with nothing new.
// A record that arrives meanwhile answers the fetch at once; this only
// bounds how stale a State is after a broker silently dropped a fetch.
const fetchMaxWait = 500 * time.Millisecond

// Freshness. Applying every record read is not enough to know a State is
// current: a consumer whose fetches stall (a wedged connection, a broker
// that drops them, a Run that stopped) reads nothing and looks just like
// one with nothing to read. So Run also asks the broker for the topic's
// end offsets every probeEvery; once the records up to the ends of an
// answer are applied, the State holds every action committed before that
// question was sent, and that moment is its AsOf.
const (
	probeEvery = 250 * time.Millisecond
	// probeTimeout bounds one question for the end offsets: under half
	// DefaultMaxStaleness, so that one question lost with its connection
	// (asked again on a new one) does not stall the processes that wait
	// for the State.
	probeTimeout = 400 * time.Millisecond
	// maxProbes bounds the answers kept while the records they wait for
	// are read: a State that far behind skips asking until it catches up.
	maxProbes = 64
	// DefaultMaxStaleness is how old a State may be before the processes
	// that act on it stop acting: the executors send no request and the
	// introspection answers nothing. It is the kill switch's promise: a
	// request leaves only on a State that holds every freeze committed
	// over a second before, so every executor honours a freeze within a
	// second, the one that stops hearing the control topic included. A
	// State that hears it is a probe (250 ms) and a round trip old.
	DefaultMaxStaleness = time.Second
)

// ErrStale: the State does not know whether it holds every action on the
// control topic: it has not confirmed that it read up to the topic's end
// within the staleness allowed. Errors returned by Current match it.
var ErrStale = errors.New("control state stale")

// StaleError is Current's error: how old the State was when the wait for
// it ended. It matches ErrStale and the context's error.
type StaleError struct {
	// AsOf is the State's AsOf when the wait ended; zero if the State
	// never caught up.
	AsOf time.Time
	// MaxStaleness is the staleness the caller allowed.
	MaxStaleness time.Duration
	// Err is the context's error that ended the wait.
	Err error
}

func (e *StaleError) Error() string {
	if e.AsOf.IsZero() {
		return fmt.Sprintf("%v: never caught up with the control topic: %v", ErrStale, e.Err)
	}
	return fmt.Sprintf("%v: known current only as of %s (%s ago; at most %s allowed): %v",
		ErrStale, e.AsOf.UTC().Format(time.RFC3339Nano), time.Since(e.AsOf).Round(time.Millisecond), e.MaxStaleness, e.Err)
}

// Is makes errors.Is(err, ErrStale) hold.
func (e *StaleError) Is(target error) bool { return target == ErrStale }

func (e *StaleError) Unwrap() error { return e.Err }

// probe is one answer to "where does the control topic end", kept until
// the records up to those ends are applied.
type probe struct {
	at   time.Time
	ends map[int32]int64
}

// origin is where a subject's latest applied record came from.
//
// A subject's records are in order within its partition. Adding
// partitions to the topic moves the subject to another one, and a State
// reading both sees its older and newer records in whatever order the
// fetches bring them, so across partitions the record's time decides.
type origin struct {
	partition int32
	at        time.Time
}

// freezeKey is a tool subject as a map key: looking it up builds no
// string, so Frozen does not allocate.
type freezeKey struct{ tool, tenant string }

// State is the current control state, rebuilt from the control topic and
// kept live by Run: the frozen tools and the revoked credentials. Lookups
// are map reads under a read lock, without allocation, for every call's
// hot path. It is safe for concurrent use.
type State struct {
	logger  *slog.Logger
	running atomic.Bool
	ready   chan struct{}
	// stopped is closed when Run returns.
	stopped chan struct{}
	// base is when the State was made; asOf counts from it on the
	// monotonic clock, so that a step of the wall clock does not make a
	// stale State look current.
	base time.Time
	// asOf is AsOf as time since base; notCaughtUp until the State first
	// caught up.
	asOf atomic.Int64

	mu sync.RWMutex
	// topic is the topic Run reads; set once Run started.
	topic string
	// tools holds the latest freeze or unfreeze per tool subject; an
	// unfreeze stays so that Service can tell it took effect.
	tools    map[freezeKey]Action
	jtis     map[string]Action
	families map[string]Action
	// policy is the latest policy activation, or nil.
	policy *Action
	// next is, per partition, the offset after the last record applied,
	// or the log's start when every record before it is gone
	// (skipEmptied).
	next map[int32]int64
	// initial are the end offsets the topic had when Run began, and
	// started when that was: Ready closes once they are covered.
	initial map[int32]int64
	started time.Time
	// readyOnce closes ready, from Run or its probes.
	readyOnce sync.Once
	// latest is, per subject, where its latest applied record came from.
	latest map[string]origin
	// partitions are the partitions Run reads.
	partitions map[int32]bool
	// probes are the answers whose ends are not yet all applied, oldest
	// (and lowest) first.
	probes []probe
	// changed is closed, and replaced, after every applied batch and
	// every advance of asOf.
	changed chan struct{}
	// passed are the records passed over (overrulesLocked), by place,
	// with the action in force instead: what their writers are
	// answered. Forgotten past maxPassed.
	passed map[place]Action
	// unrepaired are the subjects whose last record read was passed
	// over, with the action in force: it must be written again after
	// that record (Service.Run), for the topic is compacted.
	unrepaired map[string]repair
	// lastRead is, per subject, the time (At) of the last record read,
	// applied or passed over: the record a copy follows (Follows).
	lastRead map[string]time.Time
	// dropRestore is, per subject, the time of the tenant's freeze that
	// a platform unfreeze passed over put back, in the record after it:
	// passed over with it.
	dropRestore map[string]time.Time
}

// repair is an action in force to write again (Service.Run), after the
// record at after: one passed over, or the action itself when a copy
// must carry what readers added to it (a tenant's freeze it replaced).
type repair struct {
	cur   Action
	after time.Time
}

// place is a record's partition and offset.
type place struct {
	partition int32
	offset    int64
}

// maxPassed bounds State.passed: a writer asks about its record within
// seconds of writing it.
const maxPassed = 1024

// NewState returns an empty State; Run fills it. A nil logger discards.
func NewState(logger *slog.Logger) *State {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	s := &State{
		logger:      logger.With("component", "control"),
		ready:       make(chan struct{}),
		stopped:     make(chan struct{}),
		base:        time.Now(),
		tools:       make(map[freezeKey]Action),
		jtis:        make(map[string]Action),
		families:    make(map[string]Action),
		next:        make(map[int32]int64),
		latest:      make(map[string]origin),
		partitions:  make(map[int32]bool),
		changed:     make(chan struct{}),
		passed:      make(map[place]Action),
		unrepaired:  make(map[string]repair),
		lastRead:    make(map[string]time.Time),
		dropRestore: make(map[string]time.Time),
	}
	s.asOf.Store(notCaughtUp)
	return s
}

// notCaughtUp is asOf before the State first caught up.
const notCaughtUp = math.MinInt64

// Ready is closed once Run has applied every record that was on the topic
// when it started, so that an instance that waits for it before serving
// starts with the current freezes. It is never closed if Run fails first.
func (s *State) Ready() <-chan struct{} { return s.ready }

// Stopped is closed once Run has returned, its Kafka clients closed: a
// process stopping the broker it reads from (ledger dev's in-process
// Kafka) waits for it first.
func (s *State) Stopped() <-chan struct{} { return s.stopped }

// AsOf is the latest moment before which every action committed to the
// control topic is known to be applied here; zero until the State first
// caught up.
func (s *State) AsOf() time.Time {
	if d := s.asOf.Load(); d != notCaughtUp {
		return s.base.Add(time.Duration(d))
	}
	return time.Time{}
}

// Staleness is how long ago AsOf was, or -1 until the State first caught
// up.
func (s *State) Staleness() time.Duration {
	d := s.asOf.Load()
	if d == notCaughtUp {
		return -1
	}
	return max(time.Since(s.base)-time.Duration(d), 0)
}

// Current returns nil once the State is known to hold every action
// committed to the control topic up to maxStaleness ago: at once when it
// is (the hot path, without allocation), else when the State catches up.
// When ctx ends first, or Run has returned (the State will not catch up),
// it returns a *StaleError (ErrStale). maxStaleness <= 0 checks nothing.
func (s *State) Current(ctx context.Context, maxStaleness time.Duration) error {
	if maxStaleness <= 0 {
		return nil
	}
	return s.await(ctx, func() bool { return s.fresh(maxStaleness) }, maxStaleness)
}

// CurrentAsOf returns nil once the State holds every action committed to
// the control topic before t (its AsOf is t or later): a question asked
// of the broker after t has been answered, and applied. What a party
// heard of at t (a tool refusing a revoked credential) is then known
// here too, whatever its round trips to the broker take, which a bound
// on the staleness cannot say. Like Current, it returns a *StaleError
// when ctx ends first or Run has returned.
func (s *State) CurrentAsOf(ctx context.Context, t time.Time) error {
	return s.await(ctx, func() bool { return !s.AsOf().Before(t) }, time.Since(t))
}

// await returns nil once current says the State is, waiting for its
// wake-ups; allowed is the staleness the caller allowed, for its
// StaleError.
func (s *State) await(ctx context.Context, current func() bool, allowed time.Duration) error {
	if current() {
		return nil
	}
	for {
		// AsOf only moves with a wake-up: take the channel, then look.
		s.mu.RLock()
		changed := s.changed
		s.mu.RUnlock()
		if current() {
			return nil
		}
		select {
		case <-changed:
		case <-s.stopped:
			return &StaleError{AsOf: s.AsOf(), MaxStaleness: allowed, Err: ErrStopped}
		case <-ctx.Done():
			return &StaleError{AsOf: s.AsOf(), MaxStaleness: allowed, Err: ctx.Err()}
		}
	}
}

// ErrStopped: Run has returned, so the State no longer follows the topic.
var ErrStopped = errors.New("control state no longer follows the control topic")

func (s *State) fresh(maxStaleness time.Duration) bool {
	d := s.asOf.Load()
	return d != notCaughtUp && time.Since(s.base)-time.Duration(d) <= maxStaleness
}

func (s *State) isReady() bool {
	select {
	case <-s.ready:
		return true
	default:
		return false
	}
}

// Frozen reports whether tool is frozen for tenant: by a freeze for every
// tenant (returned first when both exist) or by one for that tenant. An
// empty tenant checks only the freeze for every tenant.
func (s *State) Frozen(tool, tenant string) (Action, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if a, ok := s.tools[freezeKey{tool: tool}]; ok && a.Kind == KindFreeze {
		return a, true
	}
	if tenant != "" {
		if a, ok := s.tools[freezeKey{tool: tool, tenant: tenant}]; ok && a.Kind == KindFreeze {
			return a, true
		}
	}
	return Action{}, false
}

// frozenExactly returns the latest freeze or unfreeze of exactly tool for
// tenant ("" is every tenant).
func (s *State) frozenExactly(tool, tenant string) (Action, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	a, ok := s.tools[freezeKey{tool: tool, tenant: tenant}]
	return a, ok && a.Kind == KindFreeze
}

// tenantSubjects counts tenant's subjects (its tools' freezes and
// unfreezes, its families' revocations) and reports whether subject is
// held at all.
func (s *State) tenantSubjects(tenant, subject string) (n int, present bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	for k := range s.tools {
		if k.tenant == tenant {
			n++
		}
	}
	for family := range s.families {
		if _, t, _, err := parseFamily(family); err == nil && t == tenant {
			n++
		}
	}
	_, present = s.latest[subject]
	return n, present
}

// Revoked reports whether the credential jti, or its family, is revoked;
// the jti's revocation is returned first when both are. Empty arguments
// are not looked up.
func (s *State) Revoked(jti, family string) (Action, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if jti != "" {
		if a, ok := s.jtis[jti]; ok {
			return a, true
		}
	}
	if family != "" {
		if a, ok := s.families[family]; ok {
			return a, true
		}
	}
	return Action{}, false
}

// Snapshot is the control state at one moment, each list ordered by
// subject.
type Snapshot struct {
	// Freezes are the freezes in force.
	Freezes []Action `json:"freezes"`
	// Revocations are every revoked credential and family.
	Revocations []Action `json:"revocations"`
	// Policy is the policy activation in force, if any: every role
	// decides with that version, not its --policy-dir.
	Policy *Action `json:"policy,omitempty"`
}

// Snapshot returns the freezes in force and the revocations.
func (s *State) Snapshot() Snapshot {
	s.mu.RLock()
	snap := Snapshot{Freezes: []Action{}, Revocations: make([]Action, 0, len(s.jtis)+len(s.families))}
	for _, a := range s.tools {
		if a.Kind == KindFreeze {
			snap.Freezes = append(snap.Freezes, a)
		}
	}
	for _, a := range s.jtis {
		snap.Revocations = append(snap.Revocations, a)
	}
	for _, a := range s.families {
		snap.Revocations = append(snap.Revocations, a)
	}
	if s.policy != nil && s.policy.Kind == KindActivatePolicy {
		p := *s.policy
		snap.Policy = &p
	}
	s.mu.RUnlock()
	bySubject := func(a, b Action) int { return cmp.Compare(a.Subject, b.Subject) }
	slices.SortFunc(snap.Freezes, bySubject)
	slices.SortFunc(snap.Revocations, bySubject)
	return snap
}

// Run reads the control topic from its start, applies every record, closes
// Ready once it reached the end offsets (last stable offsets) the topic
// had when Run began, and then keeps applying new records until ctx ends;
// it returns nil then. It reads committed records only, assigns every
// partition itself (no consumer group) and fails if the topic does not
// exist. Run may be called once per State.
func (s *State) Run(ctx context.Context, cc ledger.ClientConfig, topic string) error {
	if !s.running.CompareAndSwap(false, true) {
		return errors.New("control: State.Run called twice")
	}
	defer close(s.stopped)
	admin, err := ledger.NewClient(cc)
	if err != nil {
		return err
	}
	defer admin.Close()
	// Once caught up with these ends, the State holds every action
	// committed before this moment.
	started := time.Now()
	ends, err := endOffsets(ctx, admin, topic)
	if err == nil {
		err = s.skipEmptied(ctx, admin, topic, ends)
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	s.mu.Lock()
	s.topic = topic
	s.initial, s.started = ends, started
	for p := range ends {
		s.partitions[p] = true
	}
	s.mu.Unlock()

	assign := make(map[int32]kgo.Offset, len(ends))
	for p := range ends {
		assign[p] = kgo.NewOffset().AtStart()
	}
	// Control records (transaction markers) are kept: a partition whose
	// last offset is a marker is read up to its end only by seeing it.
	cl, err := ledger.NewClient(cc,
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: assign}),
		kgo.KeepControlRecords(),
		kgo.FetchMaxWait(fetchMaxWait),
	)
	if err != nil {
		return err
	}
	defer cl.Close()
	s.markReadyIf()
	probeCtx, stopProbing := context.WithCancel(ctx)
	probing := make(chan struct{})
	go func() {
		defer close(probing)
		s.probeLoop(probeCtx, admin, cl, topic)
	}()
	defer func() {
		stopProbing()
		<-probing
	}()

	for {
		fetches := cl.PollFetches(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if fetches.IsClientClosed() {
			return errors.New("control: kafka client closed")
		}
		fetches.EachError(func(t string, p int32, err error) {
			if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				// franz-go retries the fetch by itself.
				s.logger.Warn("control fetch error", "topic", t, "partition", p, "err", err)
			}
		})
		recs := fetches.Records()
		if len(recs) == 0 {
			continue
		}
		s.apply(recs)
		s.markReadyIf()
	}
}

// markReadyIf closes Ready once the records up to the end offsets the
// topic had when Run began are applied (or gone, skipEmptied), and logs
// it: the State then holds everything committed before Run began.
func (s *State) markReadyIf() {
	if s.isReady() {
		return
	}
	s.mu.Lock()
	if s.initial == nil || !s.coversLocked(s.initial) {
		s.mu.Unlock()
		return
	}
	s.advanceLocked(s.started)
	s.wakeLocked()
	s.mu.Unlock()
	closed := false
	s.readyOnce.Do(func() { close(s.ready); closed = true })
	if !closed {
		return
	}
	s.mu.RLock()
	freezes, revocations := 0, len(s.jtis)+len(s.families)
	for _, a := range s.tools {
		if a.Kind == KindFreeze {
			freezes++
		}
	}
	s.mu.RUnlock()
	s.logger.Info("control state ready", "freezes", freezes, "revocations", revocations)
}

// endOffsets returns the last stable offset of every partition of topic:
// one Metadata request, for the partitions, and one ListOffsets. The
// Metadata request goes to a broker, never to the client's cache (which
// kadm's answers from, up to 5 s old): a partition added since must count
// at once. Its answer refreshes that cache, by which franz-go sends the
// ListOffsets to each partition's leader.
func endOffsets(ctx context.Context, cl *kgo.Client, topic string) (map[int32]int64, error) {
	req := kmsg.NewPtrMetadataRequest()
	rt := kmsg.NewMetadataRequestTopic()
	rt.Topic = kmsg.StringPtr(topic)
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return nil, fmt.Errorf("describe control topic %s: %w", topic, err)
	}
	var parts []int32
	for _, t := range resp.Topics {
		if t.Topic == nil || *t.Topic != topic {
			continue
		}
		switch err := kerr.ErrorForCode(t.ErrorCode); {
		case errors.Is(err, kerr.UnknownTopicOrPartition):
			return nil, fmt.Errorf("control topic %s does not exist", topic)
		case err != nil:
			return nil, fmt.Errorf("describe control topic %s: %w", topic, err)
		}
		for _, p := range t.Partitions {
			parts = append(parts, p.Partition)
		}
	}
	if len(parts) == 0 {
		return nil, fmt.Errorf("control topic %s has no partitions", topic)
	}
	// The last stable offset: everything before it is committed or
	// aborted, and read_committed shows the committed part.
	return listOffsets(ctx, cl, topic, parts, offsetEnd)
}

// apply applies a polled batch under one write lock and wakes the waiters.
func (s *State) apply(recs []*kgo.Record) {
	live := s.isReady()
	s.mu.Lock()
	for _, r := range recs {
		s.next[r.Partition] = max(s.next[r.Partition], r.Offset+1)
		if r.Attrs.IsControl() {
			continue
		}
		s.applyLocked(r, live)
	}
	// The answers this batch caught up with, oldest first.
	n := 0
	for n < len(s.probes) && s.coversLocked(s.probes[n].ends) {
		n++
	}
	if n > 0 {
		s.advanceLocked(s.probes[n-1].at)
		s.probes = slices.Delete(s.probes, 0, n)
	}
	s.wakeLocked()
	s.mu.Unlock()
}

// wakeLocked wakes everyone waiting for the State to change.
func (s *State) wakeLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// coversLocked reports whether the records up to ends are applied. The
// record before a last stable offset is there to be read (compaction
// stops short of it) unless it belongs to an aborted transaction and
// another transaction still open keeps its abort marker past that offset:
// the State then counts as stale until that transaction ends. The
// ledger's writers of the control topic use no transactions; another
// writer that does could pause the executors for as long as it keeps a
// transaction open, never make them act on a stale State.
func (s *State) coversLocked(ends map[int32]int64) bool {
	for p, end := range ends {
		if end > 0 && s.next[p] < end {
			return false
		}
	}
	return true
}

// advanceLocked moves AsOf forward to at (never back), on the monotonic
// clock. The caller wakes the waiters.
func (s *State) advanceLocked(at time.Time) {
	if d := int64(at.Sub(s.base)); d > s.asOf.Load() {
		s.asOf.Store(d)
	}
}

// probeLoop asks for the topic's end offsets every probeEvery until ctx
// ends, and advances AsOf as far as the answers allow. Each question asks
// which partitions the topic has too (endOffsets), and has consumer read
// one added since from its start: a State that asked only about the
// partitions it read moved AsOf past a freeze written to a partition
// added meanwhile, which it had not read, and took for current a copy
// without it (for up to the 10 s between the questions that asked).
func (s *State) probeLoop(ctx context.Context, cl *kgo.Client, consumer *kgo.Client, topic string) {
	tick := time.NewTicker(probeEvery)
	defer tick.Stop()
	failing := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		s.mu.RLock()
		full := len(s.probes) >= maxProbes
		s.mu.RUnlock()
		if full {
			// Far behind: the answers kept already say where to
			// catch up to.
			continue
		}
		at := time.Now()
		pctx, cancel := context.WithTimeout(ctx, probeTimeout)
		ends, err := endOffsets(pctx, cl, topic)
		if err == nil {
			err = s.skipEmptied(pctx, cl, topic, ends)
		}
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			if !failing {
				// Once per failing spell: the staleness metric and
				// the readiness check tell how long it lasts.
				s.logger.Warn("control topic's end offsets unknown: this State's staleness grows until they are known again", "err", err)
				failing = true
			}
			continue
		}
		if failing {
			s.logger.Info("control topic's end offsets known again")
			failing = false
		}
		// A partition emptied since Run began is read to its end only
		// by skipEmptied: no record will come to say so.
		s.markReadyIf()
		if added := s.observe(at, ends); len(added) > 0 {
			assign := make(map[int32]kgo.Offset, len(added))
			for _, p := range added {
				assign[p] = kgo.NewOffset().AtStart()
			}
			consumer.AddConsumePartitions(map[string]map[int32]kgo.Offset{topic: assign})
		}
	}
}

// listOffsets asks for the offsets at (offsetEnd, offsetStart) of topic's
// partitions parts, in one ListOffsets request (franz-go sends each
// partition's part to its leader).
func listOffsets(ctx context.Context, cl *kgo.Client, topic string, parts []int32, at int64) (map[int32]int64, error) {
	req := kmsg.NewPtrListOffsetsRequest()
	req.ReplicaID = -1
	req.IsolationLevel = 1 // read_committed: the last stable offset
	rt := kmsg.NewListOffsetsRequestTopic()
	rt.Topic = topic
	for _, p := range parts {
		rp := kmsg.NewListOffsetsRequestTopicPartition()
		rp.Partition, rp.Timestamp = p, at
		rt.Partitions = append(rt.Partitions, rp)
	}
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, cl)
	if err != nil {
		return nil, fmt.Errorf("list offsets of control topic %s: %w", topic, err)
	}
	ends := make(map[int32]int64, len(parts))
	for _, t := range resp.Topics {
		for _, p := range t.Partitions {
			if err := kerr.ErrorForCode(p.ErrorCode); err != nil {
				return nil, fmt.Errorf("list offsets of control topic %s/%d: %w", topic, p.Partition, err)
			}
			ends[p.Partition] = p.Offset
		}
	}
	for _, p := range parts {
		if _, ok := ends[p]; !ok {
			return nil, fmt.Errorf("list offsets of control topic %s: no answer for partition %d", topic, p)
		}
	}
	return ends, nil
}

// The offsets listOffsets asks for, as ListOffsets names them.
const (
	offsetEnd   = -1 // the last stable offset, under read_committed
	offsetStart = -2 // the log's start
)

// skipEmptied moves next past the records of each partition of ends that
// are gone from its log up to its end (retention, or DeleteRecords, took
// them): its log starts at or past that end. A State that never read
// those records (one started since) would otherwise wait for an offset no
// record can bring it to: never ready, every call refused as stale. Only
// the partitions read short of their end are asked about, with one more
// ListOffsets; once moved, they are not asked about again.
func (s *State) skipEmptied(ctx context.Context, cl *kgo.Client, topic string, ends map[int32]int64) error {
	var short []int32
	s.mu.RLock()
	for p, end := range ends {
		if end > 0 && s.next[p] < end {
			short = append(short, p)
		}
	}
	s.mu.RUnlock()
	if len(short) == 0 {
		return nil
	}
	starts, err := listOffsets(ctx, cl, topic, short, offsetStart)
	if err != nil {
		return err
	}
	s.mu.Lock()
	for _, p := range short {
		if start := starts[p]; start >= ends[p] {
			s.next[p] = max(s.next[p], start)
		}
	}
	s.mu.Unlock()
	return nil
}

// observe takes an answer, asked at at, for the topic's end offsets, and
// returns the partitions it names that Run does not read yet: added to
// the topic since. They count as read from now on; until their records
// are applied, the State is not current.
func (s *State) observe(at time.Time, ends map[int32]int64) (added []int32) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for p := range ends {
		if !s.partitions[p] {
			s.partitions[p] = true
			added = append(added, p)
			s.logger.Warn("control topic has a partition added since this process started: reading it from its start", "partition", p)
		}
	}
	if s.coversLocked(ends) {
		// Every older answer asked for no more than this one.
		s.probes = s.probes[:0]
		s.advanceLocked(at)
		s.wakeLocked()
		return added
	}
	s.probes = append(s.probes, probe{at: at, ends: ends})
	return added
}

// overrulesLocked says why a may not change what is in force for its
// subject, and what is in force instead, or "" if it may: a tenant
// operator's freeze or unfreeze over a platform operator's freeze; an
// unfreeze of a freeze no longer in force, or a withdrawal of an
// activation no longer in force (Action.Lifts). Its writer checked these
// against its own copy of the topic, which may have lacked a record
// written through another instance at the same moment; checked here, the
// record that came second on the partition loses on every copy.
func (s *State) overrulesLocked(a Action) (string, Action) {
	if a.Reasserts != nil {
		// A control service's copy of the action in force, written
		// after a record passed over (Service.Run): it stands only for
		// that action, or for none on a topic compacted down to it.
		last, ok := s.lastLocked(a)
		if ok && !sameAction(last, *a.Reasserts) && (a.Follows == nil || !s.lastRead[a.Subject].Equal(*a.Follows)) {
			return "a copy of an action no longer in force", last
		}
		return "", Action{}
	}
	if a.Kind == KindWithdrawPolicy {
		if cur := s.policy; cur != nil && cur.Kind == KindActivatePolicy && a.Lifts != nil && !sameAction(*cur, *a.Lifts) {
			return "a withdrawal of an activation no longer in force", *cur
		}
		return "", Action{}
	}
	if a.Kind != KindFreeze && a.Kind != KindUnfreeze {
		return "", Action{}
	}
	cur, ok := s.tools[freezeKey{tool: a.Tool, tenant: a.Tenant}]
	switch {
	case !ok || cur.Kind != KindFreeze:
		return "", Action{}
	case a.ByTenant != PlatformTenant && cur.ByTenant == PlatformTenant:
		return "a tenant operator's action on a platform operator's freeze", cur
	case a.Kind == KindUnfreeze && a.Lifts != nil && !sameAction(cur, *a.Lifts):
		return "an unfreeze of a freeze no longer in force", cur
	}
	return "", Action{}
}

// lastLocked is the last action applied for a's subject (a freeze's or an
// unfreeze's, an activation's or a withdrawal's), if any.
func (s *State) lastLocked(a Action) (Action, bool) {
	switch a.Kind {
	case KindFreeze, KindUnfreeze:
		cur, ok := s.tools[freezeKey{tool: a.Tool, tenant: a.Tenant}]
		return cur, ok
	case KindActivatePolicy, KindWithdrawPolicy:
		if s.policy != nil {
			return *s.policy, true
		}
	}
	return Action{}, false
}

// sameReplaced reports whether x and y name the same tenant's freeze (or
// none).
func sameReplaced(x, y *Action) bool {
	if x == nil || y == nil {
		return x == y
	}
	return x.By == y.By && x.Reason == y.Reason && x.Made().Equal(y.Made())
}

// sameAction reports whether a is the action made at at: itself, or a
// control service's copy of it (Action.Reasserts), named by its own time
// or the original's.
func sameAction(a Action, at time.Time) bool {
	return a.At.Equal(at) || a.Made().Equal(at)
}

// passedOver reports whether the record at partition/offset, applied by
// now, was passed over (overrulesLocked), and returns the action that was
// in force instead.
func (s *State) passedOver(partition int32, offset int64) (Action, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	cur, ok := s.passed[place{partition, offset}]
	return cur, ok
}

// toRepair returns the actions in force that must go on the topic again,
// each after a record of its subject that was passed over: the subject's
// last record on the compacted topic must be the one in force, or a
// reader starting once the others are compacted away would apply the
// loser. None until the State is ready: a record passed over mid-way
// through the topic may be followed by others.
func (s *State) toRepair() []repair {
	if !s.isReady() {
		return nil
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make([]repair, 0, len(s.unrepaired))
	for _, r := range s.unrepaired {
		out = append(out, r)
	}
	return out
}

// changes returns a channel closed at the State's next change.
func (s *State) changes() <-chan struct{} {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.changed
}

// applyLocked applies one record. A record it cannot read is logged and
// skipped: the control state must keep going, and a human must look.
func (s *State) applyLocked(r *kgo.Record, live bool) {
	key := string(r.Key)
	if last, ok := s.latest[key]; ok && last.partition != r.Partition && r.Timestamp.Before(last.at) {
		s.logger.Warn("control record older than its subject's latest, from another partition: superseded", attrSubject, key,
			"partition", r.Partition, "offset", r.Offset, "latest_partition", last.partition)
		return
	}
	if r.Value == nil {
		// A tombstone: someone deleted the subject on the topic itself.
		s.latest[key] = origin{partition: r.Partition, at: r.Timestamp}
		delete(s.unrepaired, key)
		delete(s.lastRead, key)
		delete(s.dropRestore, key)
		s.deleteLocked(key)
		s.logger.Warn("control subject deleted by tombstone", attrSubject, key, "partition", r.Partition, "offset", r.Offset)
		return
	}
	var a Action
	err := json.Unmarshal(r.Value, &a)
	if err == nil {
		err = checkAction(a, key)
	}
	if err != nil {
		s.logger.Error("control record ignored", attrSubject, key, "partition", r.Partition, "offset", r.Offset, "err", err)
		return
	}
	why, cur := s.overrulesLocked(a)
	if restore, ok := s.dropRestore[key]; ok {
		delete(s.dropRestore, key)
		if last, inForce := s.lastLocked(a); why == "" && inForce && a.Kind == KindFreeze && a.At.Equal(restore) {
			why, cur = "the tenant's freeze an overruled unfreeze put back", last
		}
	}
	prevRead, hadRead := s.lastRead[key]
	s.lastRead[key] = a.At
	if why != "" {
		// Every State applies a partition in order, so every copy
		// passes over it alike. A control service puts the action in
		// force back on the topic after it (Service.Run), for
		// compaction keeps only a subject's latest record.
		s.logger.Warn("control action overruled: not applied", attrKind, a.Kind, attrSubject, a.Subject, attrBy, a.By, attrByTenant, a.ByTenant,
			"why", why, "partition", r.Partition, "offset", r.Offset)
		if len(s.passed) >= maxPassed {
			clear(s.passed)
		}
		s.passed[place{r.Partition, r.Offset}] = cur
		s.unrepaired[key] = repair{cur: cur, after: a.At}
		if a.Kind == KindUnfreeze && a.Restored != nil {
			s.dropRestore[key] = a.Restored.At
		}
		return
	}
	s.latest[key] = origin{partition: r.Partition, at: r.Timestamp}
	delete(s.unrepaired, key)
	if a.Reasserts != nil && a.Follows != nil && hadRead && !prevRead.Equal(*a.Follows) {
		// A copy applied for its original, on a reader that read
		// another record after the one it follows: a reader whose
		// view of the topic begins after that original would pass it
		// over. Copied again, following the copy. (A reader that
		// read nothing of the subject before it, on a compacted
		// topic, has nothing to settle.)
		s.unrepaired[key] = repair{cur: a, after: a.At}
	}
	switch {
	case a.Kind == KindActivatePolicy, a.Kind == KindWithdrawPolicy:
		// The withdrawal kept too: a copy of the activation it ended,
		// written late, must not bring that back (overrulesLocked).
		s.policy = &a
	case a.Kind != KindRevoke:
		k := freezeKey{tool: a.Tool, tenant: a.Tenant}
		carried := false
		if a.Kind == KindFreeze && a.ByTenant == PlatformTenant && a.Tenant != "" && a.Reasserts == nil {
			// The tenant's own freeze it replaces is the one in force
			// here, whatever its writer's copy (behind, or racing the
			// tenant's freeze or unfreeze) said: the platform's unfreeze
			// puts that back. Only a reader without the subject's
			// history takes the record's word.
			if cur, ok := s.tools[k]; ok {
				if own := tenantFreeze(cur, a.Tool, a.Tenant); !sameReplaced(own, a.Replaced) {
					a.Replaced, carried = own, true
				}
			}
		}
		s.tools[k] = a
		if r := a.Restored; a.Kind == KindUnfreeze && a.ByTenant == PlatformTenant && r != nil &&
			r.Kind == KindFreeze && r.Tool == a.Tool && r.Tenant == a.Tenant && r.ByTenant == a.Tenant {
			// The tenant's freeze a platform unfreeze puts back is in
			// force from the unfreeze on, not from its own record,
			// written after it and maybe in another batch: a reader
			// between the two would let the tenant's calls through,
			// and one whose put-back never landed (its write failed
			// after the unfreeze's) for good. The put-back's record,
			// when it comes, applies the same freeze again.
			s.tools[k] = *r
		}
		if carried {
			// On the topic it carries another, or none: a copy that does, or a
			// reader starting once compaction took the tenant's freeze
			// would lose it.
			s.unrepaired[key] = repair{cur: a, after: a.At}
		}
	case a.JTI != "":
		s.jtis[a.JTI] = a
	default:
		s.families[a.Family] = a
	}
	level := slog.LevelDebug
	if live {
		level = slog.LevelInfo
	}
	s.logger.Log(context.Background(), level, "control action applied", attrKind, a.Kind, attrSubject, a.Subject,
		attrBy, a.By, attrByTenant, a.ByTenant, "reason", a.Reason, "at", a.At)
}

func (s *State) deleteLocked(subject string) {
	switch {
	case subject == PolicySubject:
		s.policy = nil
	case strings.HasPrefix(subject, subjectJTI):
		delete(s.jtis, strings.TrimPrefix(subject, subjectJTI))
	case strings.HasPrefix(subject, subjectFamily):
		delete(s.families, strings.TrimPrefix(subject, subjectFamily))
	case strings.HasPrefix(subject, subjectTool):
		tool, tenant, _ := strings.Cut(strings.TrimPrefix(subject, subjectTool), "@")
		delete(s.tools, freezeKey{tool: tool, tenant: tenant})
	}
}

// stamp is the time for a new record of subject, written at now: after
// the subject's latest record this State applied, so that a writer whose
// clock is behind another's still orders its record last.
func (s *State) stamp(subject string, now time.Time) time.Time {
	s.mu.RLock()
	last, ok := s.latest[subject]
	s.mu.RUnlock()
	if ok && !now.After(last.at) {
		// Kafka keeps a record's time in milliseconds.
		return last.at.Add(time.Millisecond)
	}
	return now
}

// waitApplied waits until the record at topic/partition/offset has been
// applied, ctx ends or timeout passes, and reports whether it was applied.
func (s *State) waitApplied(ctx context.Context, topic string, partition int32, offset int64, timeout time.Duration) bool {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		s.mu.RLock()
		applied := s.topic == topic && s.next[partition] > offset
		changed := s.changed
		s.mu.RUnlock()
		if applied {
			return true
		}
		select {
		case <-changed:
		case <-timer.C:
			return false
		case <-ctx.Done():
			return false
		}
	}
}

// ActivePolicy returns the policy activation in force, if there is one.
func (s *State) ActivePolicy() (Action, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.policy == nil || s.policy.Kind != KindActivatePolicy {
		return Action{}, false
	}
	return *s.policy, true
}

// PolicyActivation is the latest policy activation as the policy engine
// follows it (policy.Engine.FollowActivations): its label, the content it
// pins, and its time, which tells two activations of one label apart.
func (s *State) PolicyActivation() (policy.Activation, bool) {
	a, ok := s.ActivePolicy()
	// A control service's copy of it is the same activation: its files
	// are not read again for it.
	return policy.Activation{Label: a.Policy, ID: a.Made().Format(time.RFC3339Nano), Hash: a.PolicyHash}, ok
}
