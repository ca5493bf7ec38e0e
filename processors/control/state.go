package control

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
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
	// next is, per partition, the offset after the last record applied.
	next map[int32]int64
	// changed is closed, and replaced, after every applied batch.
	changed chan struct{}
}

// NewState returns an empty State; Run fills it. A nil logger discards.
func NewState(logger *slog.Logger) *State {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &State{
		logger:   logger.With("component", "control"),
		ready:    make(chan struct{}),
		tools:    make(map[freezeKey]Action),
		jtis:     make(map[string]Action),
		families: make(map[string]Action),
		next:     make(map[int32]int64),
		changed:  make(chan struct{}),
	}
}

// Ready is closed once Run has applied every record that was on the topic
// when it started, so that an instance that waits for it before serving
// starts with the current freezes. It is never closed if Run fails first.
func (s *State) Ready() <-chan struct{} { return s.ready }

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
	ends, err := endOffsets(ctx, cc, topic)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	s.mu.Lock()
	s.topic = topic
	s.mu.Unlock()

	// pending holds the partitions not yet read up to their end.
	pending := make(map[int32]int64, len(ends))
	assign := make(map[int32]kgo.Offset, len(ends))
	for p, end := range ends {
		assign[p] = kgo.NewOffset().AtStart()
		if end > 0 {
			pending[p] = end
		}
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
	s.markReadyIf(pending)

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
		if len(pending) > 0 {
			for _, r := range recs {
				if end, ok := pending[r.Partition]; ok && r.Offset+1 >= end {
					delete(pending, r.Partition)
				}
			}
			s.markReadyIf(pending)
		}
	}
}

// markReadyIf closes Ready once no partition is pending, and logs it.
func (s *State) markReadyIf(pending map[int32]int64) {
	if len(pending) > 0 || s.isReady() {
		return
	}
	close(s.ready)
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

// endOffsets returns the last stable offset of every partition of topic.
func endOffsets(ctx context.Context, cc ledger.ClientConfig, topic string) (map[int32]int64, error) {
	admin, err := ledger.NewClient(cc)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	adm := kadm.NewClient(admin)
	details, err := adm.ListTopics(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("describe control topic %s: %w", topic, err)
	}
	d, ok := details[topic]
	switch {
	case !ok:
		return nil, fmt.Errorf("control topic %s does not exist", topic)
	case d.Err != nil:
		return nil, fmt.Errorf("describe control topic %s: %w", topic, d.Err)
	case len(d.Partitions) == 0:
		return nil, fmt.Errorf("control topic %s has no partitions", topic)
	}
	// The last stable offset: everything before it is committed or
	// aborted, and read_committed shows the committed part.
	listed, err := adm.ListCommittedOffsets(ctx, topic)
	if err != nil {
		return nil, fmt.Errorf("list offsets of control topic %s: %w", topic, err)
	}
	ends := make(map[int32]int64, len(d.Partitions))
	for p := range d.Partitions {
		o, ok := listed.Lookup(topic, p)
		if !ok {
			return nil, fmt.Errorf("list offsets of control topic %s: no answer for partition %d", topic, p)
		}
		if o.Err != nil {
			return nil, fmt.Errorf("list offsets of control topic %s/%d: %w", topic, p, o.Err)
		}
		ends[p] = o.Offset
	}
	return ends, nil
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
	close(s.changed)
	s.changed = make(chan struct{})
	s.mu.Unlock()
}

// applyLocked applies one record. A record it cannot read is logged and
// skipped: the control state must keep going, and a human must look.
func (s *State) applyLocked(r *kgo.Record, live bool) {
	key := string(r.Key)
	if r.Value == nil {
		// A tombstone: someone deleted the subject on the topic itself.
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
	switch {
	case a.Kind == KindActivatePolicy:
		s.policy = &a
	case a.Kind != KindRevoke:
		s.tools[freezeKey{tool: a.Tool, tenant: a.Tenant}] = a
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

// ActivePolicy returns the latest policy activation, if there is one.
func (s *State) ActivePolicy() (Action, bool) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.policy == nil {
		return Action{}, false
	}
	return *s.policy, true
}
