package control

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors/identity"
)

// loopback is a Publisher that applies what it publishes to a State
// directly, as if the State had read it from the topic (partition 0,
// consecutive offsets). Tests of the rules use it; the Kafka path is
// tested in state_test.go.
type loopback struct {
	state *State
	// apply false: publish without the State ever seeing it.
	apply bool

	mu   sync.Mutex
	next int64
	recs []*kgo.Record
}

func (l *loopback) Publish(_ context.Context, recs ...*kgo.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range recs {
		r.Partition, r.Offset = 0, l.next
		l.next++
		l.recs = append(l.recs, r)
	}
	if l.apply {
		l.state.apply(recs)
	}
	return nil
}

func (l *loopback) published() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.recs)
}

// readyState is a State that Run never fills: ready, on the default topic.
func readyState() *State {
	s := NewState(nil)
	s.topic = ledger.Topics{}.WithDefaults().Control
	close(s.ready)
	markCurrent(s, time.Now().Add(time.Hour))
	return s
}

// markCurrent makes s known current as of asOf, as its probe does: a
// State with no Run is current for as long as a test takes when asOf is
// an hour ahead.
func markCurrent(s *State, asOf time.Time) { s.observe(asOf, nil) }

func newLoopbackService(t *testing.T, cfg Config) (*Service, *loopback) {
	t.Helper()
	if cfg.State == nil {
		cfg.State = readyState()
	}
	pub := &loopback{state: cfg.State, apply: true}
	cfg.Publisher = pub
	if cfg.Identity == nil {
		cfg.Identity = nopVerifier{}
	}
	if cfg.Now == nil {
		cfg.Now = func() time.Time { return time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC) }
	}
	svc, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return svc, pub
}

// Who may do what (Service's doc comment), and what each action records.
func TestAuthorization(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
	tests := []struct {
		name    string
		do      func(context.Context, *Service) (Action, error)
		want    Action
		wantErr error
	}{
		{name: "platform freezes a tool for every tenant",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, platformOp, "refund_order", "", "incident 42")
			},
			want: Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order", Tool: "refund_order", By: "op_root", ByTenant: "*", Reason: "incident 42", At: at}},
		{name: "platform freezes a tool for one tenant",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, platformOp, "refund_order", "t_other", "incident 42")
			},
			want: Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order@t_other", Tool: "refund_order", Tenant: "t_other", By: "op_root", ByTenant: "*", Reason: "incident 42", At: at}},
		{name: "tenant operator's freeze is scoped to its tenant",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, acmeOp, "refund_order", "", "  our agent loops  ")
			},
			want: Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order@t_acme", Tool: "refund_order", Tenant: "t_acme", By: "op_acme", ByTenant: "t_acme", Reason: "our agent loops", At: at}},
		{name: "tenant operator names its own tenant",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, acmeOp, "refund_order", "t_acme", "r")
			},
			want: Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order@t_acme", Tool: "refund_order", Tenant: "t_acme", By: "op_acme", ByTenant: "t_acme", Reason: "r", At: at}},
		{name: "tenant operator freezes another tenant",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, acmeOp, "refund_order", "t_other", "r")
			},
			wantErr: ErrForbidden},
		{name: "no operator role",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, approver, "refund_order", "", "r")
			},
			wantErr: ErrForbidden},
		{name: "operator role under another name",
			do: func(ctx context.Context, s *Service) (Action, error) {
				op := platformOp
				op.Roles = []string{"Operator", "operators"}
				return s.Freeze(ctx, op, "refund_order", "", "r")
			},
			wantErr: ErrForbidden},
		{name: "missing reason",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, platformOp, "refund_order", "", " \n ")
			},
			wantErr: ErrInvalidRequest},
		{name: "reason too long",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, platformOp, "refund_order", "", strings.Repeat("x", MaxReasonBytes+1))
			},
			wantErr: ErrInvalidRequest},
		{name: "malformed tool",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, platformOp, "refund_order@t_acme", "", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "malformed tenant",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, platformOp, "refund_order", "t@x", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "platform tenant is not a freeze scope",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Freeze(ctx, platformOp, "refund_order", "*", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "unfreeze of a freeze not in force",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Unfreeze(ctx, platformOp, "refund_order", "", "r", time.Time{})
			},
			wantErr: ErrNotFrozen},
		{name: "unfreeze without a reason",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Unfreeze(ctx, platformOp, "refund_order", "", "", time.Time{})
			},
			wantErr: ErrInvalidRequest},
		{name: "platform revokes a jti",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, platformOp, "jti-1", "", "leaked")
			},
			want: Action{V: 1, Kind: KindRevoke, Subject: "jti:jti-1", JTI: "jti-1", By: "op_root", ByTenant: "*", Reason: "leaked", At: at}},
		{name: "platform revokes any family",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, platformOp, "", "refund_order:t_other:3", "leaked")
			},
			want: Action{V: 1, Kind: KindRevoke, Subject: "family:refund_order:t_other:3", Family: "refund_order:t_other:3", By: "op_root", ByTenant: "*", Reason: "leaked", At: at}},
		{name: "tenant operator revokes its family",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, acmeOp, "", "refund_order:t_acme:3", "leaked")
			},
			want: Action{V: 1, Kind: KindRevoke, Subject: "family:refund_order:t_acme:3", Family: "refund_order:t_acme:3", By: "op_acme", ByTenant: "t_acme", Reason: "leaked", At: at}},
		{name: "tenant operator revokes another tenant's family",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, acmeOp, "", "refund_order:t_other:3", "leaked")
			},
			wantErr: ErrForbidden},
		{name: "tenant operator's tenant as a suffix of another's",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, acmeOp, "", "refund_order:x:t_acme:3", "leaked")
			},
			wantErr: ErrForbidden},
		{name: "tenant operator revokes a jti",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, acmeOp, "jti-1", "", "leaked")
			},
			wantErr: ErrForbidden},
		{name: "revoke without a reason",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, platformOp, "jti-1", "", "")
			},
			wantErr: ErrInvalidRequest},
		{name: "revoke both a jti and a family",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, platformOp, "jti-1", "refund_order:t_acme:3", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "revoke nothing",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, platformOp, "", "", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "malformed family",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, platformOp, "", "refund_order:t_acme", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "family with a non-numeric epoch",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, platformOp, "", "refund_order:t_acme:x", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "family with a signed epoch",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, platformOp, "", "refund_order:t_acme:+3", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "family with a zero-padded epoch",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, acmeOp, "", "refund_order:t_acme:03", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "jti with a space",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, platformOp, "jti 1", "", "r")
			},
			wantErr: ErrInvalidRequest},
		// The clock reads 2026-03-04T05:06:07Z, 1772600767. A key epoch
		// more than a day ahead is no key's (here in milliseconds); one
		// a day ahead may be a key whose executor's clock was set back.
		{name: "family of a key epoch in milliseconds",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, acmeOp, "", "refund_order:t_acme:1772600767000", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "family of a key signing more than a day from now",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, acmeOp, "", "refund_order:t_acme:1772687168", "r")
			},
			wantErr: ErrInvalidRequest},
		{name: "family of a key signing a day from now",
			do: func(ctx context.Context, s *Service) (Action, error) {
				return s.Revoke(ctx, acmeOp, "", "refund_order:t_acme:1772687167", "r")
			},
			want: Action{V: 1, Kind: KindRevoke, Subject: "family:refund_order:t_acme:1772687167", Family: "refund_order:t_acme:1772687167", By: "op_acme", ByTenant: "t_acme", Reason: "r", At: at}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			svc, pub := newLoopbackService(t, Config{})
			got, err := tc.do(t.Context(), svc)
			if !errors.Is(err, tc.wantErr) {
				t.Fatalf("got %+v, %v; want error %v", got, err, tc.wantErr)
			}
			if tc.wantErr != nil {
				if n := pub.published(); n != 0 {
					t.Errorf("refused action published %d records; want 0", n)
				}
				return
			}
			if diff := cmp.Diff(tc.want, got); diff != "" {
				t.Errorf("action (-want +got):\n%s", diff)
			}
			if n := pub.published(); n != 1 {
				t.Fatalf("published %d records; want 1", n)
			}
			if key := string(pub.recs[0].Key); key != tc.want.Subject {
				t.Errorf("published under key %q; want %s", key, tc.want.Subject)
			}
		})
	}
}

// A tenant-scoped freeze stops that tenant only; a tenant operator cannot
// lift a freeze of every tenant, and unfreezing one freeze leaves the
// other.
func TestTenantScopedFreezeAndUnfreeze(t *testing.T) {
	t.Parallel()
	svc, _ := newLoopbackService(t, Config{})
	st := svc.cfg.State
	ctx := t.Context()
	m := must[Action](t)

	m(svc.Freeze(ctx, acmeOp, "refund_order", "", "our agent loops"))
	if _, ok := st.Frozen("refund_order", "t_acme"); !ok {
		t.Error("refund_order not frozen for t_acme after its operator froze it")
	}
	if a, ok := st.Frozen("refund_order", "t_other"); ok {
		t.Errorf("refund_order frozen for t_other by %+v; want only t_acme", a)
	}
	if a, ok := st.Frozen("refund_order", ""); ok {
		t.Errorf("refund_order frozen for every tenant by %+v; want only t_acme", a)
	}

	m(svc.Freeze(ctx, platformOp, "refund_order", "", "platform incident"))
	if _, ok := st.Frozen("refund_order", "t_other"); !ok {
		t.Error("refund_order not frozen for t_other after a freeze of every tenant")
	}
	// The acme operator's unfreeze is of acme's freeze only.
	m(svc.Unfreeze(ctx, acmeOp, "refund_order", "", "loop fixed", time.Time{}))
	if a, ok := st.Frozen("refund_order", "t_acme"); !ok || a.Subject != "tool:refund_order" {
		t.Errorf("after acme's unfreeze Frozen(t_acme) = %+v, %v; want the platform freeze", a, ok)
	}
	// Its calls are still refused: not "not frozen", but the platform
	// freeze it cannot lift, by name; not who made it or why, which the
	// tenant's snapshot does not show either.
	if _, err := svc.Unfreeze(ctx, acmeOp, "refund_order", "", "again", time.Time{}); !errors.Is(err, ErrForbidden) || !strings.Contains(err.Error(), "tool:refund_order is frozen for every tenant") ||
		strings.Contains(err.Error(), "op_root") || strings.Contains(err.Error(), "platform incident") {
		t.Errorf("acme unfreezing the platform freeze = %v; want ErrForbidden naming the freeze of every tenant, not its maker or reason", err)
	}
	// A platform operator's unfreeze of acme alone is told which freeze
	// is in force.
	if _, err := svc.Unfreeze(ctx, platformOp, "refund_order", "t_acme", "again", time.Time{}); !errors.Is(err, ErrNotFrozen) || !strings.Contains(err.Error(), "frozen for every tenant, tool:refund_order by op_root") {
		t.Errorf("platform unfreezing acme alone = %v; want ErrNotFrozen naming the freeze of every tenant", err)
	}
	m(svc.Unfreeze(ctx, platformOp, "refund_order", "", "incident over", time.Time{}))
	for _, tenant := range []string{"t_acme", "t_other", ""} {
		if a, ok := st.Frozen("refund_order", tenant); ok {
			t.Errorf("after both unfreezes Frozen(%q) = %+v; want not frozen", tenant, a)
		}
	}
	if snap := st.Snapshot(); len(snap.Freezes) != 0 {
		t.Errorf("snapshot after unfreezes holds freezes %+v; want none", snap.Freezes)
	}
}

// A platform operator's freeze of a tenant's tool replaces the tenant's
// own freeze of it, which the tenant then cannot lift, and carries it
// through further platform freezes; the platform's unfreeze puts the
// tenant's freeze back in force (its operator and reason, from the
// millisecond after the unfreeze) in the same write, rather than lift
// both. Before, the tenant's freeze was
// gone once the platform froze the tool, and the tool ran again for the
// tenant when the platform lifted its freeze.
func TestPlatformUnfreezeRestoresTheTenantsFreeze(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	svc, pub := newLoopbackService(t, Config{Now: func() time.Time { return now }})
	st := svc.cfg.State
	ctx := t.Context()
	m := must[Action](t)

	own := m(svc.Freeze(ctx, acmeOp, "refund_order", "", "our agent loops"))
	now = now.Add(time.Minute)
	first := m(svc.Freeze(ctx, platformOp, "refund_order", "t_acme", "incident 42"))
	if diff := cmp.Diff(&own, first.Replaced); diff != "" {
		t.Errorf("the platform's freeze replaced (-want +got):\n%s", diff)
	}
	now = now.Add(time.Minute)
	second := m(svc.Freeze(ctx, platformOp, "refund_order", "t_acme", "incident 42, widened"))
	if diff := cmp.Diff(&own, second.Replaced); diff != "" {
		t.Errorf("a second platform freeze replaced (-want +got):\n%s", diff)
	}
	if _, err := svc.Unfreeze(ctx, acmeOp, "refund_order", "", "loop fixed", own.At); !errors.Is(err, ErrForbidden) {
		t.Errorf("the tenant lifting the platform's freeze = %v; want ErrForbidden", err)
	}

	now = now.Add(time.Minute)
	n := pub.published()
	lift := m(svc.Unfreeze(ctx, platformOp, "refund_order", "t_acme", "incident over", second.At))
	restored := own
	restored.At = now.Add(time.Millisecond)
	if lift.Kind != KindUnfreeze || !cmp.Equal(&restored, lift.Restored) {
		t.Errorf("the platform's unfreeze = %+v; want an unfreeze restoring %+v", lift, restored)
	}
	if got := pub.published() - n; got != 2 {
		t.Fatalf("the platform's unfreeze published %d records; want 2, the unfreeze and the tenant's freeze", got)
	}
	if a, ok := st.Frozen("refund_order", "t_acme"); !ok || !cmp.Equal(restored, a) {
		t.Errorf("after the platform's unfreeze Frozen(t_acme) = %+v, %v; want the tenant's own freeze %+v", a, ok, restored)
	}
	if last, prev := pub.recs[len(pub.recs)-1], pub.recs[len(pub.recs)-2]; !last.Timestamp.After(prev.Timestamp) {
		t.Errorf("the restored freeze's record at %s, the unfreeze's at %s; want it after", last.Timestamp, prev.Timestamp)
	}
	// In force again from the unfreeze on: an unfreeze of the first is
	// of another freeze.
	if _, err := svc.Unfreeze(ctx, acmeOp, "refund_order", "", "loop fixed", own.At); !errors.Is(err, ErrFreezeChanged) {
		t.Errorf("the tenant lifting its first freeze by its time = %v; want ErrFreezeChanged", err)
	}
	m(svc.Unfreeze(ctx, acmeOp, "refund_order", "", "loop fixed", restored.At))
	if a, ok := st.Frozen("refund_order", "t_acme"); ok {
		t.Errorf("after the tenant's unfreeze Frozen(t_acme) = %+v; want not frozen", a)
	}

	// A platform freeze of a subject no tenant froze lifts alone.
	now = now.Add(time.Minute)
	alone := m(svc.Freeze(ctx, platformOp, "refund_order", "t_acme", "incident 43"))
	if alone.Replaced != nil {
		t.Errorf("a platform freeze over none replaced %+v", alone.Replaced)
	}
	n = pub.published()
	if lift := m(svc.Unfreeze(ctx, platformOp, "refund_order", "t_acme", "43 over", alone.At)); lift.Restored != nil || pub.published()-n != 1 {
		t.Errorf("its unfreeze restored %+v in %d records; want none, one record", lift.Restored, pub.published()-n)
	}
	if a, ok := st.Frozen("refund_order", "t_acme"); ok {
		t.Errorf("after the platform's unfreeze Frozen(t_acme) = %+v; want not frozen", a)
	}

	// A replaced freeze written by hand, under another subject and an
	// old version, is put back as this build writes it: applied. (Of a
	// tenant whose subject has no history here: with history, the
	// tenant's freeze in force is what a platform freeze replaces,
	// whatever its record says.)
	now = now.Add(time.Minute)
	odd := Action{V: 0, Kind: KindFreeze, Subject: "tool:send_email", Tool: "refund_order", Tenant: "t_beta", By: "op_beta", ByTenant: "t_beta", Reason: "by hand", At: now}
	over := Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order@t_beta", Tool: "refund_order", Tenant: "t_beta", By: "op_root", ByTenant: "*", Reason: "incident 44", At: now, Replaced: &odd}
	value, err := json.Marshal(over)
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(ctx, &kgo.Record{Key: []byte(over.Subject), Value: value, Timestamp: now}); err != nil {
		t.Fatal(err)
	}
	m(svc.Unfreeze(ctx, platformOp, "refund_order", "t_beta", "44 over", over.At))
	if a, ok := st.Frozen("refund_order", "t_beta"); !ok || a.Reason != "by hand" || a.Subject != "tool:refund_order@t_beta" {
		t.Errorf("after the platform's unfreeze of a hand-written freeze Frozen(t_acme) = %+v, %v; want the tenant's own put back", a, ok)
	}
}

// An unfreeze naming the freeze it means to lift (its time) does not lift
// another: frozen again since the operator looked, for another incident,
// the tool stays frozen until an unfreeze names that freeze. Before, an
// unfreeze lifted whatever freeze was in force under the subject.
func TestUnfreezeOfAReplacedFreezeIsRefused(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 12, 4, 12, 0, 0, 0, time.UTC)
	svc, _ := newLoopbackService(t, Config{Now: func() time.Time { return now }})
	st := svc.cfg.State
	ctx := t.Context()
	m := must[Action](t)

	first := m(svc.Freeze(ctx, platformOp, "refund_order", "", "incident 41"))
	now = now.Add(time.Minute)
	second := m(svc.Freeze(ctx, platformOp, "refund_order", "", "incident 42"))
	_, err := svc.Unfreeze(ctx, platformOp, "refund_order", "", "41 is over", first.At)
	if !errors.Is(err, ErrFreezeChanged) || !strings.Contains(err.Error(), "incident 42") {
		t.Errorf("unfreeze of the first freeze, replaced: %v; want ErrFreezeChanged naming the freeze in force", err)
	}
	if a, ok := st.Frozen("refund_order", ""); !ok || a.Reason != "incident 42" {
		t.Errorf("after the refused unfreeze: Frozen = %+v, %v; want the second freeze in force", a, ok)
	}
	m(svc.Unfreeze(ctx, platformOp, "refund_order", "", "42 is over", second.At))
	if a, ok := st.Frozen("refund_order", ""); ok {
		t.Errorf("after the unfreeze of the freeze in force: Frozen = %+v; want none", a)
	}
}

func TestRevoke(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)
	svc, pub := newLoopbackService(t, Config{Now: func() time.Time { return now }})
	st := svc.cfg.State
	ctx := t.Context()
	m := must[Action](t)

	if _, ok := st.Revoked("jti-1", "refund_order:t_acme:3"); ok {
		t.Fatal("revoked before any revocation")
	}
	byJTI := m(svc.Revoke(ctx, platformOp, "jti-1", "", "leaked"))
	if got, ok := st.Revoked("jti-1", "refund_order:t_acme:4"); !ok || got != byJTI {
		t.Errorf("Revoked(jti-1) = %+v, %v; want %+v", got, ok, byJTI)
	}
	if _, ok := st.Revoked("jti-2", "refund_order:t_acme:4"); ok {
		t.Error("another jti of another family is revoked")
	}
	byFamily := m(svc.Revoke(ctx, acmeOp, "", "refund_order:t_acme:3", "executor compromised"))
	if got, ok := st.Revoked("jti-2", "refund_order:t_acme:3"); !ok || got != byFamily {
		t.Errorf("Revoked(family) = %+v, %v; want %+v", got, ok, byFamily)
	}
	// Revoking again, while the revocation still covers every credential
	// issued since (within the skew), keeps it and publishes nothing.
	n := pub.published()
	now = now.Add(svc.cfg.RevocationSkew)
	again := m(svc.Revoke(ctx, platformOp, "", "refund_order:t_acme:3", "another reason"))
	if again != byFamily || pub.published() != n {
		t.Errorf("second revocation = %+v with %d new records; want the first, %+v, and none", again, pub.published()-n, byFamily)
	}
	if again := m(svc.Revoke(ctx, platformOp, "jti-1", "", "again")); again != byJTI || pub.published() != n {
		t.Errorf("revoking a revoked jti = %+v with %d new records; want the first, %+v, and none", again, pub.published()-n, byJTI)
	}
	// Later, the family has gone on being minted: a revocation now covers
	// those credentials too (a tenant operator has no other way to revoke
	// one that leaked).
	now = now.Add(time.Hour)
	later := m(svc.Revoke(ctx, acmeOp, "", "refund_order:t_acme:3", "leaked again"))
	if !later.At.Equal(now) || later.Reason != "leaked again" || pub.published() != n+1 {
		t.Errorf("revocation an hour later = %+v with %d new records; want one as of %v", later, pub.published()-n, now)
	}
	if got, ok := st.Revoked("jti-3", "refund_order:t_acme:3"); !ok || got != later {
		t.Errorf("Revoked(family) after the second revocation = %+v, %v; want %+v", got, ok, later)
	}
}

// A tenant operator sees the freezes that affect its tenant and its own
// families' revocations; a platform operator sees everything.
func TestSnapshotVisibility(t *testing.T) {
	t.Parallel()
	svc, _ := newLoopbackService(t, Config{})
	ctx := t.Context()
	m := must[Action](t)
	m(svc.Freeze(ctx, platformOp, "refund_order", "", "t_other's agent abuses refunds"))
	m(svc.Freeze(ctx, acmeOp, "send_email", "", "r"))
	m(svc.Freeze(ctx, otherOp, "send_email", "", "r"))
	m(svc.Revoke(ctx, platformOp, "jti-1", "", "r"))
	m(svc.Revoke(ctx, acmeOp, "", "refund_order:t_acme:1", "r"))
	m(svc.Revoke(ctx, otherOp, "", "refund_order:t_other:1", "r"))

	subjects := func(as []Action) []string {
		out := []string{}
		for _, a := range as {
			out = append(out, a.Subject)
		}
		return out
	}
	tests := []struct {
		name        string
		op          func() (Snapshot, error)
		freezes     []string
		revocations []string
	}{
		{name: "platform", op: func() (Snapshot, error) { return svc.Snapshot(ctx, platformOp) },
			freezes:     []string{"tool:refund_order", "tool:send_email@t_acme", "tool:send_email@t_other"},
			revocations: []string{"family:refund_order:t_acme:1", "family:refund_order:t_other:1", "jti:jti-1"}},
		{name: "acme", op: func() (Snapshot, error) { return svc.Snapshot(ctx, acmeOp) },
			freezes:     []string{"tool:refund_order", "tool:send_email@t_acme"},
			revocations: []string{"family:refund_order:t_acme:1"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			snap, err := tc.op()
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.freezes, subjects(snap.Freezes)); diff != "" {
				t.Errorf("freezes (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tc.revocations, subjects(snap.Revocations)); diff != "" {
				t.Errorf("revocations (-want +got):\n%s", diff)
			}
		})
	}
	// Who froze a tool for every tenant, and why, is the platform's: the
	// reason may speak of other tenants.
	for _, tc := range []struct {
		op              identity.Identity
		wantBy, wantWhy string
	}{
		{platformOp, platformOp.User, "t_other's agent abuses refunds"},
		{acmeOp, "", ""},
	} {
		snap, err := svc.Snapshot(ctx, tc.op)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range snap.Freezes {
			switch {
			case a.Tenant == "" && (a.By != tc.wantBy || a.Reason != tc.wantWhy):
				t.Errorf("%s sees the freeze of every tenant's by %q for %q; want by %q for %q", tc.op.Tenant, a.By, a.Reason, tc.wantBy, tc.wantWhy)
			case a.Tenant != "" && (a.By == "" || a.Reason == ""):
				t.Errorf("%s sees its own tenant's freeze without who or why: %+v", tc.op.Tenant, a)
			}
		}
	}
	if _, err := svc.Snapshot(ctx, approver); !errors.Is(err, ErrForbidden) {
		t.Errorf("Snapshot by a non-operator = %v; want ErrForbidden", err)
	}
}

// A tenant operator's actions keep at most MaxTenantSubjects subjects on
// the control topic for the tenant: made-up tool names or key epochs in a
// loop would each stay for good, and every process of every tenant reads
// the topic whole before it starts. Acting again on a subject the tenant
// has adds nothing, and a platform operator is not bounded.
func TestTenantSubjectsBounded(t *testing.T) {
	t.Parallel()
	svc, _ := newLoopbackService(t, Config{MaxTenantSubjects: 3})
	ctx := t.Context()
	m := must[Action](t)
	m(svc.Freeze(ctx, acmeOp, "t00001", "", "r"))
	m(svc.Freeze(ctx, acmeOp, "t00002", "", "r"))
	m(svc.Unfreeze(ctx, acmeOp, "t00002", "", "r", time.Time{}))
	m(svc.Revoke(ctx, acmeOp, "", "refund_order:t_acme:1", "r"))
	// Another tenant's subjects do not count against t_acme's.
	m(svc.Freeze(ctx, otherOp, "t00009", "", "r"))
	if _, err := svc.Freeze(ctx, acmeOp, "t00003", "", "r"); !errors.Is(err, ErrTooManySubjects) {
		t.Errorf("a fourth tool's freeze by t_acme's operator = %v; want ErrTooManySubjects", err)
	}
	if _, err := svc.Revoke(ctx, acmeOp, "", "refund_order:t_acme:2", "r"); !errors.Is(err, ErrTooManySubjects) {
		t.Errorf("a fourth subject, a family's revocation, by t_acme's operator = %v; want ErrTooManySubjects", err)
	}
	m(svc.Freeze(ctx, acmeOp, "t00002", "", "again"))
	m(svc.Freeze(ctx, platformOp, "t00003", "t_acme", "r"))
	m(svc.Revoke(ctx, platformOp, "", "refund_order:t_acme:2", "r"))
}

// A State that has not caught up cannot tell what is in force: the
// service refuses until it has.
func TestNotReady(t *testing.T) {
	t.Parallel()
	svc, pub := newLoopbackService(t, Config{State: NewState(nil)})
	ctx := t.Context()
	for name, do := range map[string]func() error{
		"freeze": func() error { _, err := svc.Freeze(ctx, platformOp, "refund_order", "", "r"); return err },
		"unfreeze": func() error {
			_, err := svc.Unfreeze(ctx, platformOp, "refund_order", "", "r", time.Time{})
			return err
		},
		"revoke":   func() error { _, err := svc.Revoke(ctx, platformOp, "jti-1", "", "r"); return err },
		"snapshot": func() error { _, err := svc.Snapshot(ctx, platformOp); return err },
	} {
		if err := do(); !errors.Is(err, ErrNotReady) {
			t.Errorf("%s before Ready = %v; want ErrNotReady", name, err)
		}
	}
	if n := pub.published(); n != 0 {
		t.Errorf("published %d records before Ready; want 0", n)
	}
}

// An action the local State does not apply in time is returned with
// ErrNotYetApplied: it was published, and it is not claimed in force here.
func TestNotYetApplied(t *testing.T) {
	t.Parallel()
	svc, pub := newLoopbackService(t, Config{ApplyWait: 20 * time.Millisecond})
	pub.apply = false
	a, err := svc.Freeze(t.Context(), platformOp, "refund_order", "", "r")
	if !errors.Is(err, ErrNotYetApplied) {
		t.Fatalf("Freeze = %+v, %v; want ErrNotYetApplied", a, err)
	}
	if a.Subject != "tool:refund_order" || pub.published() != 1 {
		t.Errorf("Freeze returned %+v after %d publishes; want the published action", a, pub.published())
	}
}

func TestConfigValidation(t *testing.T) {
	t.Parallel()
	st, pub := readyState(), &loopback{}
	tests := []struct {
		name string
		cfg  Config
	}{
		{"no state", Config{Publisher: pub, Identity: nopVerifier{}}},
		{"no publisher", Config{State: st, Identity: nopVerifier{}}},
		{"no identity", Config{State: st, Publisher: pub}},
		{"negative wait", Config{State: st, Publisher: pub, Identity: nopVerifier{}, ApplyWait: -time.Second}},
	}
	for _, tc := range tests {
		if _, err := New(tc.cfg); err == nil {
			t.Errorf("New(%s) = nil error; want one", tc.name)
		}
	}
}

// A platform operator's freeze of one tenant's tool is the platform's to
// lift: that tenant's operator neither lifts it nor replaces it with a
// freeze of its own (which it could then lift). Once the platform lifts
// it, the tenant's operator freezes and unfreezes as before.
func TestTenantOperatorDoesNotLiftAPlatformFreeze(t *testing.T) {
	t.Parallel()
	svc, pub := newLoopbackService(t, Config{})
	st := svc.cfg.State
	ctx := t.Context()
	m := must[Action](t)

	m(svc.Freeze(ctx, platformOp, "refund_order", "t_acme", "t_acme's agent abuses refunds"))
	before := pub.published()
	if _, err := svc.Unfreeze(ctx, acmeOp, "refund_order", "", "we fixed it", time.Time{}); !errors.Is(err, ErrForbidden) || !strings.Contains(err.Error(), "op_root") {
		t.Errorf("acme's unfreeze of the platform's freeze of t_acme = %v; want ErrForbidden naming the platform operator", err)
	}
	if _, err := svc.Freeze(ctx, acmeOp, "refund_order", "", "ours now"); !errors.Is(err, ErrForbidden) {
		t.Errorf("acme's freeze over the platform's freeze of t_acme = %v; want ErrForbidden", err)
	}
	if n := pub.published(); n != before {
		t.Errorf("%d records published for the refused actions; want none", n-before)
	}
	if a, ok := st.Frozen("refund_order", "t_acme"); !ok || a.ByTenant != PlatformTenant || a.Reason != "t_acme's agent abuses refunds" {
		t.Errorf("Frozen(t_acme) = %+v, %v; want the platform's freeze, as it was", a, ok)
	}

	m(svc.Unfreeze(ctx, platformOp, "refund_order", "t_acme", "contained", time.Time{}))
	m(svc.Freeze(ctx, acmeOp, "refund_order", "", "our own reasons"))
	m(svc.Unfreeze(ctx, acmeOp, "refund_order", "", "done", time.Time{}))
	if a, ok := st.Frozen("refund_order", "t_acme"); ok {
		t.Errorf("Frozen(t_acme) = %+v after acme's own freeze and unfreeze; want not frozen", a)
	}
}

// An unfreeze is checked against a copy of the control topic known
// current: on a stale one (its fetches stalled, say) the freeze in force
// may be a newer one than the copy shows, which the unfreeze must not
// lift. It is refused (ErrStale, 503 over HTTP) and publishes nothing; a
// platform operator's freeze goes out all the same.
func TestUnfreezeOnAStaleCopyIsRefused(t *testing.T) {
	t.Parallel()
	stale := readyState()
	svc, pub := newLoopbackService(t, Config{State: stale, Identity: asOperator{platformOp}})
	ctx := t.Context()
	m := must[Action](t)
	first := m(svc.Freeze(ctx, platformOp, "refund_order", "", "incident 41"))
	m(svc.Freeze(ctx, acmeOp, "send_email", "", "ours"))

	stale.asOf.Store(int64(-time.Minute)) // known current only a minute before it was made
	before := pub.published()
	if _, err := svc.Unfreeze(ctx, platformOp, "refund_order", "", "41 is over", first.At); !errors.Is(err, ErrStale) {
		t.Errorf("unfreeze on a stale copy = %v; want ErrStale", err)
	}
	if _, err := svc.Freeze(ctx, acmeOp, "send_email", "", "again"); !errors.Is(err, ErrStale) {
		t.Errorf("a tenant operator's freeze on a stale copy = %v; want ErrStale", err)
	}
	// Nor is a stale copy shown as the freezes in force: one made or
	// lifted elsewhere would look not made (ledger control show, the
	// console's health page).
	if _, err := svc.Snapshot(ctx, platformOp); !errors.Is(err, ErrStale) {
		t.Errorf("the snapshot of a stale copy = %v; want ErrStale", err)
	}
	if n := pub.published(); n != before {
		t.Errorf("%d records published on a stale copy; want none", n-before)
	}
	m(svc.Freeze(ctx, platformOp, "get_weather", "", "incident 43"))
	if _, ok := stale.Frozen("get_weather", "t_a"); !ok {
		t.Error("the platform's freeze on a stale copy was not applied; want it published")
	}

	srv := httptest.NewServer(svc.Handler())
	t.Cleanup(srv.Close)
	req, err := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/control/unfreeze", strings.NewReader(`{"tool":"refund_order","reason":"over"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer x")
	req.Header.Set("Content-Type", "application/json")
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Errorf("unfreeze over HTTP on a stale copy = %d (Retry-After %q); want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}

// asOperator takes every assertion for its operator's.
type asOperator struct{ id identity.Identity }

func (a asOperator) Verify(context.Context, string) (identity.Identity, error) { return a.id, nil }

// racing is a Publisher through which another instance's records land
// first on the topic, before the first records published through it: a
// write this instance's copy had not read when its service checked.
type racing struct {
	*loopback
	first []*kgo.Record
}

func (r *racing) Publish(ctx context.Context, recs ...*kgo.Record) error {
	if first := r.first; first != nil {
		r.first = nil
		if err := r.loopback.Publish(ctx, first...); err != nil {
			return err
		}
	}
	return r.loopback.Publish(ctx, recs...)
}

// recordOf is a as a control topic record.
func recordOf(t *testing.T, a Action) *kgo.Record {
	t.Helper()
	value, err := json.Marshal(a)
	if err != nil {
		t.Fatal(err)
	}
	return &kgo.Record{Key: []byte(a.Subject), Value: value, Timestamp: a.At}
}

// A freeze, an unfreeze or a withdrawal checked against a copy that had
// not yet read a record written meanwhile through another instance is
// passed over by every copy and refused to its operator as if the copy
// had been current; and Run writes the action in force again after it,
// since the compacted topic keeps a subject's last record alone, whoever
// wrote the loser (here, a writer that stopped before it could). Before,
// the record that came second won: a tenant operator's unfreeze lifted
// the platform's freeze that landed first, an unfreeze meant for one
// freeze lifted the newer one another operator had just made, and a
// withdrawal ended the activation made meanwhile.
func TestRacedActionIsOverruled(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	tenantFreeze := Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order@t_acme", Tool: "refund_order", Tenant: "t_acme",
		By: "op_acme", ByTenant: "t_acme", Reason: "our agent loops", At: at}
	platformFreeze := Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order@t_acme", Tool: "refund_order", Tenant: "t_acme",
		By: "op_root", ByTenant: PlatformTenant, Reason: "incident 9", At: at.Add(time.Second), Replaced: &tenantFreeze}
	refrozen := tenantFreeze
	refrozen.By, refrozen.Reason, refrozen.At = "op_acme2", "another loop", at.Add(2*time.Second)
	v42 := Action{V: 1, Kind: KindActivatePolicy, Subject: PolicySubject, Policy: "v42", By: "op_root", ByTenant: PlatformTenant, Reason: "rollout", At: at}
	v43 := v42
	v43.Policy, v43.By, v43.At = "v43", "op_root2", at.Add(2*time.Second)
	unfreeze := func(svc *Service) error {
		_, err := svc.Unfreeze(t.Context(), acmeOp, "refund_order", "", "loop fixed", time.Time{})
		return err
	}
	withdraw := func(svc *Service) error {
		_, err := svc.WithdrawPolicy(t.Context(), platformOp, "v42 denies everything")
		return err
	}
	for _, tc := range []struct {
		name           string
		before, winner Action
		do             func(*Service) error
		wantErr        error
	}{
		{"a tenant's unfreeze behind a platform freeze", tenantFreeze, platformFreeze, unfreeze, ErrForbidden},
		{"an unfreeze behind a newer freeze", tenantFreeze, refrozen, unfreeze, ErrFreezeChanged},
		{"a withdrawal behind a newer activation", v42, v43, withdraw, ErrActivationChanged},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := readyState()
			st.apply([]*kgo.Record{recordOf(t, tc.before)})
			pub := &racing{loopback: &loopback{state: st, apply: true, next: 1}, first: []*kgo.Record{recordOf(t, tc.winner)}}
			svc, err := New(Config{State: st, Publisher: pub, Identity: nopVerifier{}, Now: func() time.Time { return at.Add(3 * time.Second) }})
			if err != nil {
				t.Fatal(err)
			}
			if err := tc.do(svc); !errors.Is(err, tc.wantErr) {
				t.Errorf("the action = %v; want %v", err, tc.wantErr)
			}
			inForce := func() (Action, bool) {
				if tc.winner.Kind == KindActivatePolicy {
					return st.ActivePolicy()
				}
				return st.Frozen("refund_order", "t_acme")
			}
			if a, ok := inForce(); !ok || a.By != tc.winner.By || !a.At.Equal(tc.winner.At) {
				t.Errorf("in force after the race: %+v, %v; want %s's", a, ok, tc.winner.By)
			}
			// The loser is the subject's last record until Run writes
			// the winner again.
			runUntilLast(t, svc, pub.loopback, tc.winner.By+"'s written again", func(a Action) bool {
				return a.Kind == tc.winner.Kind && a.By == tc.winner.By && a.Reasserts != nil && a.Reasserts.Equal(tc.winner.At)
			})
			if a, ok := inForce(); !ok || a.By != tc.winner.By {
				t.Errorf("in force after the repair: %+v, %v; want %s's", a, ok, tc.winner.By)
			}
		})
	}
}

// A platform operator withdraws the policy activation in force: the
// withdrawal (who, why, the version and the time of the activation it
// ends) goes on the topic, and the State has no activation. A tenant
// operator may not, and with none in force it is refused not_active.
// Before, nothing withdrew one: a version that did not load denied every
// call until another was activated. control show names it.
func TestWithdrawPolicy(t *testing.T) {
	t.Parallel()
	svc, pub := newLoopbackService(t, Config{})
	st := svc.cfg.State
	ctx := t.Context()
	if _, err := svc.WithdrawPolicy(ctx, platformOp, "nothing to withdraw"); !errors.Is(err, ErrNotActive) {
		t.Errorf("WithdrawPolicy with none in force = %v; want ErrNotActive", err)
	}
	act := must[Action](t)(svc.ActivatePolicy(ctx, platformOp, "v42", "", "rollout"))
	if snap, err := svc.Snapshot(ctx, platformOp); err != nil || snap.Policy == nil || snap.Policy.Policy != "v42" {
		t.Errorf("Snapshot = %+v, %v; want the activation of v42 shown", snap.Policy, err)
	}
	if _, err := svc.WithdrawPolicy(ctx, acmeOp, "not mine"); !errors.Is(err, ErrForbidden) {
		t.Errorf("a tenant operator's WithdrawPolicy = %v; want ErrForbidden", err)
	}
	before := pub.published()
	w, err := svc.WithdrawPolicy(ctx, platformOp, "v42 denies everything")
	if err != nil || w.Kind != KindWithdrawPolicy || w.Policy != "v42" || w.By != "op_root" || w.Lifts == nil || !w.Lifts.Equal(act.At) {
		t.Fatalf("WithdrawPolicy = %+v, %v; want the withdrawal of v42 by op_root, naming its activation", w, err)
	}
	if a, ok := st.ActivePolicy(); ok {
		t.Errorf("after the withdrawal the activation in force is %+v; want none", a)
	}
	if n := pub.published() - before; n != 1 {
		t.Errorf("%d records published; want the withdrawal alone", n)
	}
	if snap, err := svc.Snapshot(ctx, platformOp); err != nil || snap.Policy != nil {
		t.Errorf("Snapshot = %+v, %v; want no activation shown", snap.Policy, err)
	}
}

// A freeze of a tool the registry does not hold is refused unknown_tool,
// for a name mistyped in an incident would freeze nothing while its
// operator took it for done; asked for (one only newer executors know),
// it goes out. Before, every name was frozen, and the console counted it.
func TestFreezeOfAnUnknownTool(t *testing.T) {
	t.Parallel()
	svc, pub := newLoopbackService(t, Config{KnownTool: func(tool string) bool { return tool == "refund_order" }, Identity: asOperator{platformOp}})
	ctx := t.Context()
	if _, err := svc.Freeze(ctx, platformOp, "refund_ordr", "", "incident 42"); !errors.Is(err, ErrUnknownTool) {
		t.Errorf("Freeze(refund_ordr) = %v; want ErrUnknownTool", err)
	}
	if n := pub.published(); n != 0 {
		t.Fatalf("%d records published; want none", n)
	}
	must[Action](t)(svc.Freeze(ctx, platformOp, "refund_order", "", "incident 42"))
	must[Action](t)(svc.FreezeUnknown(ctx, platformOp, "refund_v2", "", "rolling out"))
	if _, ok := svc.cfg.State.Frozen("refund_v2", "t_acme"); !ok {
		t.Error("a tool frozen as asked, though unknown here, is not frozen")
	}
	// Through HTTP: 400 unknown_tool, and allow_unknown_tool.
	srv := httptest.NewServer(svc.Handler())
	t.Cleanup(srv.Close)
	for body, want := range map[string]int{
		`{"tool":"nosuch","reason":"r"}`:                           http.StatusBadRequest,
		`{"tool":"nosuch","reason":"r","allow_unknown_tool":true}`: http.StatusOK,
	} {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/control/freeze", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer the-platform-operator")
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var e struct{ Error apiError }
		_ = json.NewDecoder(resp.Body).Decode(&e)
		resp.Body.Close()
		if resp.StatusCode != want || want == http.StatusBadRequest && e.Error.Code != CodeUnknownTool {
			t.Errorf("POST freeze %s = %d %q; want %d", body, resp.StatusCode, e.Error.Code, want)
		}
	}
}

// A control service's copy of the action in force, written after a
// record passed over, stands only while that action is the subject's
// last: a platform operator's unfreeze landing between the loser and the
// copy is not undone by it, and is itself written again after it. And a
// copy on a topic compacted down to it alone applies. Before, the copy
// was the action itself, applied whatever came before it: it froze again
// a tool the platform had just unfrozen, answered 200.
func TestRepairDoesNotUndoALaterAction(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	platformFreeze := Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order@t_acme", Tool: "refund_order", Tenant: "t_acme",
		By: "op_root", ByTenant: PlatformTenant, Reason: "incident 9", At: at}
	lifts := platformFreeze.At
	loser := Action{V: 1, Kind: KindUnfreeze, Subject: platformFreeze.Subject, Tool: "refund_order", Tenant: "t_acme",
		By: "op_acme", ByTenant: "t_acme", Reason: "loop fixed", At: at.Add(time.Second), Lifts: &lifts}
	unfreeze := loser
	unfreeze.By, unfreeze.ByTenant, unfreeze.Reason, unfreeze.At = "op_root", PlatformTenant, "incident over", at.Add(2*time.Second)
	st := readyState()
	st.apply([]*kgo.Record{recordOf(t, platformFreeze), {Key: []byte(loser.Subject), Value: recordOf(t, loser).Value, Offset: 1}})
	if _, ok := st.Frozen("refund_order", "t_acme"); !ok {
		t.Fatal("the tenant's unfreeze lifted the platform's freeze; the test needs it passed over")
	}
	// The platform's unfreeze lands before the repair does.
	pub := &racing{loopback: &loopback{state: st, apply: true, next: 2}, first: []*kgo.Record{recordOf(t, unfreeze)}}
	svc, err := New(Config{State: st, Publisher: pub, Identity: nopVerifier{}, Now: func() time.Time { return at.Add(3 * time.Second) }})
	if err != nil {
		t.Fatal(err)
	}
	runUntilLast(t, svc, pub.loopback, "the platform's unfreeze written again after the freeze's copy", func(a Action) bool {
		return a.Kind == KindUnfreeze && a.By == "op_root" && a.Reasserts != nil
	})
	if a, ok := st.Frozen("refund_order", "t_acme"); ok {
		t.Errorf("frozen by %+v after the repair; want the platform's unfreeze in force", a)
	}
	// A topic compacted down to a copy alone: it applies.
	made := at
	fresh := readyState()
	fresh.apply([]*kgo.Record{recordOf(t, Action{V: 1, Kind: KindFreeze, Subject: platformFreeze.Subject, Tool: "refund_order", Tenant: "t_acme",
		By: "op_root", ByTenant: PlatformTenant, Reason: "incident 9", At: at.Add(time.Hour), Reasserts: &made})})
	if _, ok := fresh.Frozen("refund_order", "t_acme"); !ok {
		t.Error("a copy of a freeze alone on the topic is not applied; want it in force")
	}
}

// A platform operator's freeze of a tenant's tool that lands on the
// tenant's own freeze, written meanwhile and not yet in the platform
// writer's copy, carries it on every copy, and the platform's unfreeze
// puts it back. Before, the tenant's freeze, answered 200, was lost: the
// tool ran for the tenant once the platform lifted its own.
func TestPlatformFreezeCarriesATenantFreezeWrittenMeanwhile(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	tenantFreeze := Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order@t_acme", Tool: "refund_order", Tenant: "t_acme",
		By: "op_acme", ByTenant: "t_acme", Reason: "our agent loops", At: at}
	st := readyState()
	pub := &racing{loopback: &loopback{state: st, apply: true}, first: []*kgo.Record{recordOf(t, tenantFreeze)}}
	now := at.Add(time.Second)
	svc, err := New(Config{State: st, Publisher: pub, Identity: nopVerifier{}, Now: func() time.Time { return now }})
	if err != nil {
		t.Fatal(err)
	}
	p := must[Action](t)(svc.Freeze(t.Context(), platformOp, "refund_order", "t_acme", "incident 9"))
	if p.Replaced != nil {
		t.Fatalf("the platform's freeze as written carries %+v; the test needs its writer's copy to have lacked the tenant's", p.Replaced)
	}
	now = at.Add(2 * time.Second)
	must[Action](t)(svc.Unfreeze(t.Context(), platformOp, "refund_order", "t_acme", "incident over", time.Time{}))
	if a, ok := st.Frozen("refund_order", "t_acme"); !ok || a.By != "op_acme" {
		t.Errorf("after the platform's unfreeze: %+v, frozen %v; want the tenant's own freeze back in force", a, ok)
	}
}

// copyOf is a control service's copy of a, written at at after the record
// made at follows (Service.Run).
func copyOf(a Action, at, follows time.Time) Action {
	made := a.Made()
	c := a
	c.At, c.Reasserts, c.Follows = at, &made, &follows
	return c
}

// Copies of actions (Service.Run's), and what is made of them. A tenant's
// freeze in force as a copy, replaced by a platform freeze and put back by
// its unfreeze, is the tenant's freeze again, not a copy that no longer
// stands (before, it was passed over and the tool ran for the tenant); an
// unfreeze of a copy names the original's time; a reader that applied the
// loser a copy follows (the topic compacted between them) applies the
// copy; and a platform freeze that carries on every copy the tenant's
// freeze written meanwhile is written again carrying it, for a reader
// starting once compaction took the tenant's.
func TestCopiesOfActions(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	subject := "tool:refund_order@t_acme"
	tenantFreeze := Action{V: 1, Kind: KindFreeze, Subject: subject, Tool: "refund_order", Tenant: "t_acme", By: "op_acme", ByTenant: "t_acme", Reason: "loops", At: at}
	records := func(as ...Action) []*kgo.Record { return recordsOf(t, as...) }
	t.Run("a tenant's freeze in force as a copy, put back", func(t *testing.T) {
		st := readyState()
		st.apply(records(tenantFreeze, copyOf(tenantFreeze, at.Add(time.Minute), at)))
		now := at.Add(2 * time.Minute)
		svc, pub := newLoopbackService(t, Config{State: st, Now: func() time.Time { return now }})
		pub.next = 2
		must[Action](t)(svc.Freeze(t.Context(), platformOp, "refund_order", "t_acme", "incident 9"))
		now = now.Add(time.Minute)
		u := must[Action](t)(svc.Unfreeze(t.Context(), platformOp, "refund_order", "t_acme", "incident over", time.Time{}))
		if u.Restored == nil || u.Restored.Reasserts != nil {
			t.Errorf("the unfreeze puts back %+v; want the tenant's freeze itself, not a copy", u.Restored)
		}
		if a, ok := st.Frozen("refund_order", "t_acme"); !ok || a.By != "op_acme" {
			t.Errorf("after the platform's unfreeze: %+v, %v; want the tenant's freeze in force", a, ok)
		}
	})
	t.Run("an unfreeze of a copy names the original", func(t *testing.T) {
		st := readyState()
		st.apply(records(tenantFreeze, copyOf(tenantFreeze, at.Add(time.Minute), at)))
		svc, pub := newLoopbackService(t, Config{State: st})
		pub.next = 2
		u := must[Action](t)(svc.Unfreeze(t.Context(), acmeOp, "refund_order", "", "fixed", time.Time{}))
		if u.Lifts == nil || !u.Lifts.Equal(at) {
			t.Errorf("the unfreeze lifts %v; want the original freeze's time %v", u.Lifts, at)
		}
	})
	t.Run("a reader that applied the loser a copy follows", func(t *testing.T) {
		refrozen := tenantFreeze
		refrozen.At = at.Add(time.Minute)
		lifts := at
		loser := Action{V: 1, Kind: KindUnfreeze, Subject: subject, Tool: "refund_order", Tenant: "t_acme", By: "op_acme", ByTenant: "t_acme", Reason: "fixed", At: at.Add(2 * time.Minute), Lifts: &lifts}
		// Compacted: the first freeze and the one refrozen are gone.
		st := readyState()
		st.apply(records(loser, copyOf(refrozen, at.Add(3*time.Minute), loser.At)))
		if a, ok := st.Frozen("refund_order", "t_acme"); !ok || !a.Made().Equal(refrozen.At) {
			t.Errorf("Frozen = %+v, %v; want the copy of the freeze made again in force", a, ok)
		}
		if r := st.toRepair(); len(r) != 0 {
			t.Errorf("to repair %+v; want nothing", r)
		}
	})
	t.Run("a carried freeze is written again carrying it", func(t *testing.T) {
		st := readyState()
		pub := &racing{loopback: &loopback{state: st, apply: true}, first: []*kgo.Record{recordOf(t, tenantFreeze)}}
		svc, err := New(Config{State: st, Publisher: pub, Identity: nopVerifier{}, Now: func() time.Time { return at.Add(time.Second) }})
		if err != nil {
			t.Fatal(err)
		}
		must[Action](t)(svc.Freeze(t.Context(), platformOp, "refund_order", "t_acme", "incident 9"))
		runUntilLast(t, svc, pub.loopback, "the platform's freeze written again, carrying the tenant's", func(a Action) bool {
			return a.Reasserts != nil && a.Replaced != nil && a.Replaced.By == "op_acme"
		})
	})
}

// runUntilLast runs svc's repairs until the last record published through
// pub holds an action done reports, for at most 10 s (what: the record
// wanted, for the failure).
func runUntilLast(t *testing.T, svc *Service, pub *loopback, what string, done func(Action) bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	go svc.Run(ctx)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		pub.mu.Lock()
		var last *kgo.Record
		if n := len(pub.recs); n > 0 {
			last = pub.recs[n-1]
		}
		pub.mu.Unlock()
		var a Action
		if last != nil && json.Unmarshal(last.Value, &a) == nil && done(a) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the topic's last record: %v; want %s", last, what)
		}
	}
}

// What every copy makes of sequences a fifth read found settled wrongly.
// A reader whose view of the topic begins after a copy's original (the
// topic compacted) applies the copy when its last record read, applied or
// passed over, is the one the copy follows, and a full reader copies
// again a copy applied for its original but following another record; a
// platform freeze replaces the tenant's freeze in force here, not the one
// its writer's copy held (lifted since); and the tenant's freeze an
// overruled platform unfreeze puts back is passed over with it.
func TestSettledOnTheTopic(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	subject := "tool:refund_order@t_acme"
	tenantOp := func(kind string, at time.Time, lifts *time.Time) Action {
		return Action{V: 1, Kind: kind, Subject: subject, Tool: "refund_order", Tenant: "t_acme", By: "op_acme", ByTenant: "t_acme", Reason: "r", At: at, Lifts: lifts}
	}
	records := func(as ...Action) []*kgo.Record { return recordsOf(t, as...) }
	t0 := tenantOp(KindFreeze, at, nil)
	f1 := Action{V: 1, Kind: KindFreeze, Subject: subject, Tool: "refund_order", Tenant: "t_acme", By: "op_root", ByTenant: PlatformTenant, Reason: "incident", At: at.Add(time.Minute), Replaced: &t0}
	t.Run("a view beginning at a loser applies the copy that follows it", func(t *testing.T) {
		lifts := t0.At
		x1 := tenantOp(KindFreeze, at.Add(2*time.Minute), nil)
		y := tenantOp(KindUnfreeze, at.Add(3*time.Minute), &lifts)
		st := readyState()
		st.apply(records(x1, y, copyOf(f1, at.Add(4*time.Minute), y.At)))
		if a, ok := st.Frozen("refund_order", "t_acme"); !ok || a.ByTenant != PlatformTenant {
			t.Errorf("Frozen = %+v, %v; want the platform's freeze (its copy) in force", a, ok)
		}
	})
	t.Run("a copy following an earlier loser is copied again", func(t *testing.T) {
		lifts := t0.At
		x1 := tenantOp(KindUnfreeze, at.Add(2*time.Minute), &lifts)
		y := tenantOp(KindUnfreeze, at.Add(3*time.Minute), &lifts)
		c := copyOf(f1, at.Add(4*time.Minute), x1.At)
		full := readyState()
		full.apply(records(t0, f1, x1, y, c))
		r := full.toRepair()
		if len(r) != 1 || r[0].cur.Reasserts == nil || !r[0].after.Equal(c.At) {
			t.Fatalf("to repair %+v; want the copy copied again, following it", r)
		}
		partial := readyState()
		partial.apply(records(x1, y, c, copyOf(r[0].cur, at.Add(5*time.Minute), r[0].after)))
		if a, ok := partial.Frozen("refund_order", "t_acme"); !ok || a.ByTenant != PlatformTenant {
			t.Errorf("a view beginning at the losers: Frozen = %+v, %v; want the platform's freeze in force", a, ok)
		}
	})
	t.Run("a platform freeze replaces the tenant's freeze in force", func(t *testing.T) {
		lifts := t0.At
		ut := tenantOp(KindUnfreeze, at.Add(30*time.Second), &lifts)
		st := readyState()
		st.apply(records(t0, ut, f1))
		svc, pub := newLoopbackService(t, Config{State: st, Now: func() time.Time { return at.Add(time.Hour) }})
		pub.next = 3
		u := must[Action](t)(svc.Unfreeze(t.Context(), platformOp, "refund_order", "t_acme", "over", time.Time{}))
		if u.Restored != nil {
			t.Errorf("the platform's unfreeze puts back %+v; want nothing, the tenant lifted its freeze", u.Restored)
		}
		if a, ok := st.Frozen("refund_order", "t_acme"); ok {
			t.Errorf("frozen by %+v; want nothing in force", a)
		}
	})
	// restoring is a platform unfreeze of f1 by by at when, which puts
	// t0 back, and that put-back.
	restoring := func(by string, when time.Time) (u, back Action) {
		fLifts := f1.At
		u = Action{V: 1, Kind: KindUnfreeze, Subject: subject, Tool: "refund_order", Tenant: "t_acme", By: by, ByTenant: PlatformTenant, Reason: "a", At: when, Lifts: &fLifts}
		back = t0
		back.At = u.At.Add(time.Millisecond)
		u.Restored = &back
		return u, back
	}
	t.Run("an unfreeze's put-back is in force from the unfreeze on", func(t *testing.T) {
		// Its own record not read yet, or never written (its write
		// failed after the unfreeze's).
		u, back := restoring("op_root", at.Add(2*time.Minute))
		st := readyState()
		st.apply(records(t0, f1, u))
		if a, ok := st.Frozen("refund_order", "t_acme"); !ok || !cmp.Equal(back, a) {
			t.Errorf("Frozen after the unfreeze alone = %+v, %v; want the tenant's freeze it puts back, %+v", a, ok, back)
		}
		st.apply(records(t0, f1, u, back)[3:])
		if a, ok := st.Frozen("refund_order", "t_acme"); !ok || !cmp.Equal(back, a) {
			t.Errorf("Frozen after the put-back's own record = %+v, %v; want the same freeze, %+v", a, ok, back)
		}
	})
	t.Run("an overruled unfreeze's put-back is passed over with it", func(t *testing.T) {
		uA, tA := restoring("op_root", at.Add(2*time.Minute))
		uB, tB := restoring("op_root2", at.Add(3*time.Minute))
		st := readyState()
		st.apply(records(t0, f1, uA, tA, uB, tB))
		if a, ok := st.Frozen("refund_order", "t_acme"); !ok || !a.At.Equal(tA.At) {
			t.Errorf("Frozen = %+v, %v; want the freeze the first unfreeze put back", a, ok)
		}
		if _, passed := st.passedOver(0, 5); !passed {
			t.Error("the second unfreeze's put-back was applied; want it passed over with its unfreeze")
		}
	})
}

// recordsOf are the records of as, at offsets 0, 1, ... of one partition.
func recordsOf(t *testing.T, as ...Action) []*kgo.Record {
	t.Helper()
	var recs []*kgo.Record
	for i, a := range as {
		r := recordOf(t, a)
		r.Offset = int64(i)
		recs = append(recs, r)
	}
	return recs
}

// A platform operator's freeze does not wait for a request holding its
// subject's stripe (a tenant operator's, waiting up to a second for a
// copy that stalled): the emergency brake waits for nobody. And a reader
// starting on a topic compacted down to a copy applies it and copies
// nothing: it read nothing else of the subject to settle. Before, the
// freeze queued behind every such request, and every restart after
// compaction wrote each such copy again.
func TestBrakeAndCopiesAfterCompaction(t *testing.T) {
	t.Parallel()
	svc, _ := newLoopbackService(t, Config{})
	unlock := svc.lockSubject(ToolSubject("refund_order", "t_acme"))
	defer unlock()
	done := make(chan error, 1)
	go func() {
		_, err := svc.Freeze(t.Context(), platformOp, "refund_order", "t_acme", "incident 9")
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("platform freeze = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the platform's freeze waited for the subject's stripe")
	}
	at := time.Date(2026, 12, 6, 12, 0, 0, 0, time.UTC)
	freeze := Action{V: 1, Kind: KindFreeze, Subject: "tool:refund_order@t_acme", Tool: "refund_order", Tenant: "t_acme", By: "op_acme", ByTenant: "t_acme", Reason: "r", At: at}
	st := readyState()
	st.apply(recordsOf(t, copyOf(freeze, at.Add(time.Hour), at.Add(time.Minute))))
	if _, ok := st.Frozen("refund_order", "t_acme"); !ok {
		t.Error("a copy alone on the topic is not applied")
	}
	if r := st.toRepair(); len(r) != 0 {
		t.Errorf("to repair %+v; want nothing", r)
	}
}
