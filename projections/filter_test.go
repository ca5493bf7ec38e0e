package projections

import (
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// A call id, a trace id and a state go through query parameters and
// come back the same.
func TestValuesRoundTrip(t *testing.T) {
	now := time.Date(2026, 11, 30, 14, 0, 0, 0, time.UTC)
	for _, f := range []Filter{
		{Tenant: "t_1", CallID: "c-1"},
		{AllTenants: true, TraceID: "4bf92f3577b34da6a3ce929d0e0e4736", Tool: "refund_order", Since: now.Add(-time.Hour)},
		{Tenant: "t_1", State: statemachine.StateOutcomeUnknown, Until: now, Limit: 5},
		{Tenant: "t_1", JTI: "j", State: statemachine.StateSucceeded, CallID: "c-2", TraceID: "tr"},
		{AllTenants: true, Role: "contractor", Decision: "deny"},
		{AllTenants: true, ToolDigest: "sha256:ee73feadf9785bb74043d9d7feab3b832debf6925884d394230384e60fdcdaf5", Tool: "refund_order"},
	} {
		v := f.Values()
		got, err := FilterFromValues(v, now)
		if err != nil {
			t.Errorf("FilterFromValues(%s): %v", v.Encode(), err)
			continue
		}
		if diff := cmp.Diff(f, got); diff != "" {
			t.Errorf("FilterFromValues(%s) (-want +got):\n%s", v.Encode(), diff)
		}
	}
}

// A call id and a trace id are references; a state is not, and only a
// blast radius takes one, of a state the machine knows.
func TestFilterCallTraceState(t *testing.T) {
	for _, tc := range []struct {
		name       string
		f          Filter
		references bool
		blast      error
		outcomes   error
		unresolved error
	}{
		{"call id", Filter{Tenant: "t", CallID: "c"}, true, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"trace id", Filter{Tenant: "t", TraceID: "tr"}, true, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"tool digest", Filter{Tenant: "t", ToolDigest: "sha256:ee73feadf9785bb74043d9d7feab3b832debf6925884d394230384e60fdcdaf5"}, true, nil, ErrInvalidFilter, ErrInvalidFilter},
		// As a trace's table shows it: it would match nothing.
		{"tool digest cut short", Filter{Tenant: "t", ToolDigest: "sha256:ee73feadf978"}, true, ErrInvalidFilter, ErrInvalidFilter, ErrInvalidFilter},
		{"tool digest in capitals", Filter{Tenant: "t", ToolDigest: "sha256:EE73FEADF9785BB74043D9D7FEAB3B832DEBF6925884D394230384E60FDCDAF5"}, true, ErrInvalidFilter, ErrInvalidFilter, ErrInvalidFilter},
		{"role", Filter{Tenant: "t", Role: "contractor"}, true, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"a role's denials", Filter{Tenant: "t", Role: "contractor", Decision: "deny"}, true, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"a decision alone", Filter{Tenant: "t", Decision: "deny"}, false, ErrInvalidFilter, ErrInvalidFilter, ErrInvalidFilter},
		{"state", Filter{Tenant: "t", State: statemachine.StateDenied}, false, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"state with a jti", Filter{Tenant: "t", JTI: "j", State: statemachine.StateSucceeded}, true, nil, ErrInvalidFilter, ErrInvalidFilter},
		{"unknown state", Filter{Tenant: "t", State: "done"}, false, ErrInvalidFilter, ErrInvalidFilter, ErrInvalidFilter},
		{"state without a tenant", Filter{State: statemachine.StateDenied}, false, ErrTenantRequired, ErrTenantRequired, ErrTenantRequired},
		{"neither", Filter{Tenant: "t", Tool: "x"}, false, nil, nil, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.f.References(); got != tc.references {
				t.Errorf("References() = %v; want %v", got, tc.references)
			}
			if _, err := tc.f.Check(); !errors.Is(err, tc.blast) {
				t.Errorf("Check() = %v; want %v", err, tc.blast)
			}
			if _, err := CheckOutcomes(tc.f, time.Minute, time.Unix(3600, 0)); !errors.Is(err, tc.outcomes) {
				t.Errorf("CheckOutcomes() = %v; want %v", err, tc.outcomes)
			}
			if _, err := CheckUnresolved(tc.f); !errors.Is(err, tc.unresolved) {
				t.Errorf("CheckUnresolved() = %v; want %v", err, tc.unresolved)
			}
		})
	}
}

// An Outcomes question spans at most MaxOutcomeBuckets epoch-aligned
// buckets; a window without until ends now, one without since begins at
// the epoch.
func TestCheckOutcomesBuckets(t *testing.T) {
	now := time.Date(2026, 11, 30, 14, 0, 0, 500_000_000, time.UTC)
	since := time.Date(2026, 11, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		name    string
		f       Filter
		bucket  time.Duration
		buckets int64 // that the window spans
		err     error
	}{
		{"a day by the minute", Filter{Tenant: "t", Since: now.Add(-24 * time.Hour), Until: now}, time.Minute, 1440, nil},
		{"the bound by the second", Filter{Tenant: "t", Since: since, Until: since.Add(MaxOutcomeBuckets * time.Second)}, time.Second, MaxOutcomeBuckets, nil},
		{"one over the bound", Filter{Tenant: "t", Since: since, Until: since.Add((MaxOutcomeBuckets + 1) * time.Second)}, time.Second, MaxOutcomeBuckets + 1, ErrInvalidFilter},
		// Buckets are aligned on the epoch: 100 minutes from hh:mm:30
		// touch 101 of them.
		{"unaligned", Filter{Tenant: "t", Since: since.Add(30 * time.Second), Until: since.Add(100*time.Minute + 30*time.Second)}, time.Minute, 101, nil},
		{"a month by the second", Filter{Tenant: "t", Since: since, Until: since.AddDate(0, 1, 0)}, time.Second, 30 * 86400, ErrInvalidFilter},
		// Without until, to now (its second included).
		{"since, to now", Filter{Tenant: "t", Since: now.Add(-time.Hour)}, time.Second, 3601, nil},
		{"a month ago, to now", Filter{Tenant: "t", Since: now.AddDate(0, -1, 0)}, time.Second, 2678401, ErrInvalidFilter},
		// Without since, from the epoch.
		{"no window by the hour", Filter{AllTenants: true}, time.Hour, 1 + now.Unix()/3600, ErrInvalidFilter},
		{"no window by the week", Filter{AllTenants: true}, 7 * 24 * time.Hour, 1 + now.Unix()/(7*86400), nil},
		{"until only by the minute", Filter{Tenant: "t", Until: time.Unix(MaxOutcomeBuckets*60, 0)}, time.Minute, MaxOutcomeBuckets, nil},
		{"since after now", Filter{Tenant: "t", Since: now.Add(time.Hour)}, time.Second, 0, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			from, to := tc.f.Since, tc.f.Until
			if from.IsZero() {
				from = time.Unix(0, 0)
			}
			if to.IsZero() {
				to = now.Truncate(time.Second).Add(time.Second)
			}
			if got := Buckets(from, to, tc.bucket); got != tc.buckets {
				t.Errorf("Buckets(%s, %s, %s) = %d; want %d", from, to, tc.bucket, got, tc.buckets)
			}
			if _, err := CheckOutcomes(tc.f, tc.bucket, now); !errors.Is(err, tc.err) {
				t.Errorf("CheckOutcomes(%+v, %s) = %v; want %v", tc.f, tc.bucket, err, tc.err)
			}
		})
	}
}

// ParseTime reads whole days ("7d"), as incident questions are asked and
// README's examples ask them, besides Go's durations and RFC 3339; a
// negative or fractional count of days is refused as before.
func TestParseTimeDays(t *testing.T) {
	now := time.Date(2026, 12, 7, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		in   string
		want time.Time
		err  bool
	}{
		{in: "7d", want: now.Add(-7 * 24 * time.Hour)},
		{in: "0d", want: now},
		{in: "36h", want: now.Add(-36 * time.Hour)},
		{in: "2026-12-01T00:00:00Z", want: time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)},
		{in: "-1d", err: true},
		{in: "1.5d", err: true},
		{in: "d", err: true},
	} {
		got, err := ParseTime(tc.in, now)
		if (err != nil) != tc.err || !tc.err && !got.Equal(tc.want) {
			t.Errorf("ParseTime(%q) = %v, %v; want %v (error %v)", tc.in, got, err, tc.want, tc.err)
		}
	}
}

// An outcomes question's since is taken back to the start of its bucket:
// asked at 14:37 for the last two hours by the hour, the first bucket,
// labelled 12:00, counted only from 12:37, and read as a drop.
func TestCheckOutcomesStartsAtABucket(t *testing.T) {
	since := time.Date(2026, 12, 8, 12, 37, 12, 0, time.UTC)
	for _, tc := range []struct {
		bucket time.Duration
		want   time.Time
	}{
		{time.Hour, time.Date(2026, 12, 8, 12, 0, 0, 0, time.UTC)},
		{5 * time.Minute, time.Date(2026, 12, 8, 12, 35, 0, 0, time.UTC)},
		{time.Second, since},
	} {
		f, err := CheckOutcomes(Filter{Tenant: "t", Since: since}, tc.bucket, since.Add(2*time.Hour))
		if err != nil || !f.Since.Equal(tc.want) {
			t.Errorf("CheckOutcomes(since %s, bucket %s) since = %s, %v; want %s", since.Format(time.TimeOnly), tc.bucket, f.Since.Format(time.TimeOnly), err, tc.want.Format(time.TimeOnly))
		}
	}
}

// A jti or a policy version in a form no event carries is refused, or
// taken for the one it names, rather than matching nothing and answering
// "0 calls": a jti pasted from the CSV with the quote a spreadsheet puts
// before a cell starting with -, a policy version with the whole content
// hash an activation pins.
func TestFilterReferenceForms(t *testing.T) {
	const short = "3f2a9c1b0d7e"
	whole := short + "5bb74043d9d7feab3b832debf6925884d394230384e60fdcdaf5"
	for _, tc := range []struct {
		name string
		f    Filter
		want string // the policy version asked, or "" when refused
	}{
		{"a jti", Filter{Tenant: "t", JTI: "-Xr3aQ_9b2VtZXRoaW5nAA"}, ""},
		{"a jti quoted", Filter{Tenant: "t", JTI: "'-Xr3aQ_9b2VtZXRoaW5nAA"}, "refused"},
		{"a jti with a space", Filter{Tenant: "t", JTI: "Xr3aQ 9b2VtZXRoaW5nAA"}, "refused"},
		{"a label", Filter{Tenant: "t", PolicyVersion: "v41"}, "v41"},
		{"a version", Filter{Tenant: "t", PolicyVersion: "v41@" + short}, "v41@" + short},
		{"the whole hash", Filter{Tenant: "t", PolicyVersion: "v41@" + whole}, "v41@" + short},
		{"the whole sha256", Filter{Tenant: "t", PolicyVersion: "v41@sha256:" + whole}, "v41@" + short},
		{"a hash cut elsewhere", Filter{Tenant: "t", PolicyVersion: "v41@" + short[:8]}, "refused"},
		{"a hash in capitals", Filter{Tenant: "t", PolicyVersion: "v41@3F2A9C1B0D7E"}, "refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, err := tc.f.Check()
			switch {
			case tc.want == "refused" && !errors.Is(err, ErrInvalidFilter):
				t.Errorf("Check() = %v; want ErrInvalidFilter", err)
			case tc.want != "refused" && err != nil:
				t.Errorf("Check() = %v; want it taken", err)
			case tc.want != "refused" && f.PolicyVersion != tc.want:
				t.Errorf("policy version asked %q; want %q", f.PolicyVersion, tc.want)
			}
		})
	}
}
