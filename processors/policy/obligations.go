package policy

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cedar-policy/cedar-go"

	"github.com/toolcall-ledger/ledger/schemas"
)

// The annotation keys the engine reads from a policy.
const (
	annotationID         = "id"
	annotationObligation = "obligation"
	annotationMask       = "mask"
	annotationRateLimit  = "rate_limit"
	annotationSandbox    = "sandbox"
)

// obligationWords are what an annotation the engine does not read must
// not hold (its name lowercased, without "_"): one that does is
// an obligation misspelt (@require_approval, @ratelimit("20/m"),
// @obligations), which, read as a note, would turn a rule into a plain
// allow. Any other (@description, @owner, @reason...) is a note for the
// policy's readers, and ignored.
var obligationWords = []string{"oblig", "approv", "mask", "limit", "sandbox", "undounknown", "redact", "quota"}

// misspeltObligation reports whether k, an annotation the engine does not
// read, looks like one it would (obligationWords).
func misspeltObligation(k string) bool {
	k = strings.ReplaceAll(strings.ToLower(k), "_", "")
	return slices.ContainsFunc(obligationWords, func(w string) bool { return strings.Contains(k, w) })
}

// The values @obligation accepts, alone or comma-separated.
const (
	obligationRequireApproval = "require_approval"
	obligationSandbox         = "sandbox"
	// obligationUndoUnknown: if the call's outcome turns out unknown and
	// cannot be established, run the tool's declared compensation.
	obligationUndoUnknown = "undo_unknown"
)

// Obligations are the conditions an allow comes with, read from the
// annotations of the permits that decided it. The zero value means "no
// conditions".
type Obligations struct {
	// RequireApproval routes the call to approval_pending: a human
	// approves the exact arguments before it runs.
	RequireApproval bool
	// Mask lists fields (JSON pointers such as "/card_number", or bare
	// names) masked in the result. Sorted, without duplicates. The audit
	// copy of the arguments hides these and those of every other policy
	// for the tool (Decision.AuditMask).
	Mask []string
	// RateLimits cap the calls per tenant and tool that their policies
	// decide: one per deciding policy with a @rate_limit, sorted by
	// policy id. Each is a budget of its own, and a call is charged to
	// every one of them or, if any is spent, refused and charged to
	// none: a looser limit is not waived because a stricter one also
	// decides.
	RateLimits []RateLimit
	// Sandbox asks the executor to run the call against the tool's
	// sandbox backend.
	Sandbox bool
	// UndoUnknown asks the reconciler to run the tool's declared
	// compensation when the call's outcome is unknown and cannot be
	// established, instead of leaving it to a human.
	UndoUnknown bool
}

// IsZero reports whether o carries no obligation.
func (o Obligations) IsZero() bool {
	return !o.RequireApproval && len(o.Mask) == 0 && len(o.RateLimits) == 0 && !o.Sandbox && !o.UndoUnknown
}

// List returns o as the strings events carry (ledger.Event.Obligations), in
// a stable order: "require_approval", "mask:<field>" per field,
// "rate_limit:<n>/<unit>" per rate limit (in RateLimits' order, so two
// policies with the same limit give two equal entries), "sandbox",
// "undo_unknown".
func (o Obligations) List() []string {
	var l []string
	if o.RequireApproval {
		l = append(l, obligationRequireApproval)
	}
	for _, m := range o.Mask {
		l = append(l, "mask:"+m)
	}
	for _, rl := range o.RateLimits {
		l = append(l, "rate_limit:"+rl.String())
	}
	if o.Sandbox {
		l = append(l, obligationSandbox)
	}
	if o.UndoUnknown {
		l = append(l, obligationUndoUnknown)
	}
	return l
}

// Merge adds p's obligations to o: flags are or-ed, masks united (sorted,
// without duplicates), and rate limits all kept, one per policy (sorted by
// policy id). Several permits deciding together all apply, and so do two
// decisions of one call (an approved call's, and the executor's re-check
// of it).
func (o Obligations) Merge(p Obligations) Obligations {
	o.RequireApproval = o.RequireApproval || p.RequireApproval
	o.Sandbox = o.Sandbox || p.Sandbox
	o.UndoUnknown = o.UndoUnknown || p.UndoUnknown
	if len(p.Mask) > 0 {
		m := append(slices.Clone(o.Mask), p.Mask...)
		slices.Sort(m)
		o.Mask = slices.Compact(m)
	}
	if len(p.RateLimits) > 0 {
		rls := append(slices.Clone(o.RateLimits), p.RateLimits...)
		slices.SortStableFunc(rls, func(a, b RateLimit) int { return strings.Compare(a.Policy, b.Policy) })
		// A policy merged twice still has one budget.
		o.RateLimits = slices.CompactFunc(rls, func(a, b RateLimit) bool { return a.Policy == b.Policy })
	}
	return o
}

// RateLimit is at most N calls per Per, per tenant and tool, or, By a
// user or an agent, per tenant, tool and user (or agent).
type RateLimit struct {
	N   int
	Per time.Duration
	// By is whose budget it is within the tenant: RateByTenant (the
	// zero value: the whole tenant's), RateByUser (each verified user's
	// own) or RateByAgent (each agent's own).
	By string
	// Policy is the id of the policy whose @rate_limit this is. Each
	// policy's limit is a budget of its own: two permits of one tool
	// with different limits (or the same) do not draw on each other's.
	Policy string
}

// Whose budget a rate limit is (RateLimit.By).
const (
	RateByTenant = ""
	RateByUser   = "user"
	RateByAgent  = "agent"
)

// String returns the annotation form, such as "20/m" or "20/m by user".
func (r RateLimit) String() string {
	unit := "s"
	switch r.Per {
	case time.Minute:
		unit = "m"
	case time.Hour:
		unit = "h"
	}
	s := strconv.Itoa(r.N) + "/" + unit
	if r.By != RateByTenant {
		s += " by " + r.By
	}
	return s
}

// maxRateN bounds N so that a typo like "60000000000/s" is a load error
// rather than an effectively unlimited limit someone believes is strict.
const maxRateN = 1_000_000

// parseRateLimit reads "<n>/<unit>" with unit s, m or h, optionally
// followed by "by user" or "by agent" (whitespace between the words).
func parseRateLimit(s string) (RateLimit, error) {
	limit, by := strings.TrimSpace(s), RateByTenant
	if fields := strings.Fields(limit); len(fields) > 1 {
		if len(fields) != 3 || fields[1] != "by" || (fields[2] != RateByUser && fields[2] != RateByAgent) {
			return RateLimit{}, fmt.Errorf("rate limit %q: want <n>/<unit> such as 20/m, optionally followed by \"by user\" or \"by agent\"", s)
		}
		limit, by = fields[0], fields[2]
	}
	n, unit, ok := strings.Cut(limit, "/")
	if !ok {
		return RateLimit{}, fmt.Errorf("rate limit %q: want <n>/<unit> such as 20/m", s)
	}
	v, err := strconv.Atoi(n)
	if err != nil || v < 1 || v > maxRateN {
		return RateLimit{}, fmt.Errorf("rate limit %q: count must be an integer from 1 to %d", s, maxRateN)
	}
	var per time.Duration
	switch unit {
	case "s":
		per = time.Second
	case "m":
		per = time.Minute
	case "h":
		per = time.Hour
	default:
		return RateLimit{}, fmt.Errorf("rate limit %q: unit must be s, m or h", s)
	}
	return RateLimit{N: v, Per: per, By: by}, nil
}

// parseObligations reads a policy's obligation annotations. A malformed or
// unknown value is an error: an obligation misspelt and silently ignored
// would turn a "needs approval" rule into a plain allow.
func parseObligations(a cedar.Annotations) (Obligations, error) {
	var o Obligations
	for k := range a {
		switch k := string(k); {
		case k == annotationID, k == annotationObligation, k == annotationMask, k == annotationRateLimit, k == annotationSandbox:
		case misspeltObligation(k):
			return o, fmt.Errorf("@%s: not an annotation the engine reads, and it looks like an obligation, which would be ignored (the engine reads @%s, @%s, @%s and @%s)", k,
				annotationObligation, annotationMask, annotationRateLimit, annotationSandbox)
		}
	}
	if v, ok := a[annotationObligation]; ok {
		items := splitList(string(v))
		if len(items) == 0 {
			return o, fmt.Errorf("@obligation is empty")
		}
		for _, it := range items {
			switch it {
			case obligationRequireApproval:
				o.RequireApproval = true
			case obligationSandbox:
				o.Sandbox = true
			case obligationUndoUnknown:
				o.UndoUnknown = true
			default:
				return o, fmt.Errorf("@obligation %q: unknown obligation (want %s, %s or %s)", it, obligationRequireApproval, obligationSandbox, obligationUndoUnknown)
			}
		}
	}
	if v, ok := a[annotationMask]; ok {
		items := splitList(string(v))
		if len(items) == 0 {
			return o, fmt.Errorf("@mask is empty")
		}
		for _, it := range items {
			if strings.HasPrefix(it, "/") && len(it) == 1 {
				return o, fmt.Errorf("@mask %q: the whole document cannot be masked", it)
			}
			if !schemas.ValidRedaction(it) {
				return o, fmt.Errorf("@mask %q: not a JSON pointer (every ~ is ~0 or ~1) or a field name", it)
			}
		}
		slices.Sort(items)
		o.Mask = slices.Compact(items)
	}
	if v, ok := a[annotationRateLimit]; ok {
		rl, err := parseRateLimit(string(v))
		if err != nil {
			return o, fmt.Errorf("@%s: %w", annotationRateLimit, err)
		}
		o.RateLimits = []RateLimit{rl}
	}
	if v, ok := a[annotationSandbox]; ok {
		// A bare @sandbox is @sandbox("") in Cedar.
		switch v {
		case "", "true":
			o.Sandbox = true
		case "false":
		default:
			return o, fmt.Errorf("@sandbox %q: want no value, \"true\" or \"false\"", string(v))
		}
	}
	return o, nil
}

// splitList splits a comma-separated annotation value, dropping blanks.
func splitList(s string) []string {
	var l []string
	for it := range strings.SplitSeq(s, ",") {
		if it = strings.TrimSpace(it); it != "" {
			l = append(l, it)
		}
	}
	return l
}
