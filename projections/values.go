package projections

import (
	"fmt"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/toolcall-ledger/ledger/statemachine"
)

// The query parameters of a Filter, as the HTTP API and the CLI name them.
const (
	ParamTenant           = "tenant"
	ParamAllTenants       = "all_tenants"
	ParamJTI              = "jti"
	ParamCredentialFamily = "credential_family"
	ParamTool             = "tool"
	ParamPolicyVersion    = "policy_version"
	ParamDecision         = "decision"
	ParamRole             = "role"
	ParamApprover         = "approver"
	ParamApprovalID       = "approval_id"
	ParamCallID           = "call_id"
	ParamTraceID          = "trace_id"
	ParamToolDigest       = "tool_digest"
	ParamState            = "state"
	ParamSince            = "since"
	ParamUntil            = "until"
	ParamLimit            = "limit"
	ParamBucket           = "bucket"
)

// Values returns f as query parameters; FilterFromValues reads them back.
func (f Filter) Values() url.Values {
	v := url.Values{}
	set := func(k, s string) {
		if s != "" {
			v.Set(k, s)
		}
	}
	set(ParamTenant, f.Tenant)
	if f.AllTenants {
		v.Set(ParamAllTenants, "true")
	}
	set(ParamJTI, f.JTI)
	set(ParamCredentialFamily, f.CredentialFamily)
	set(ParamTool, f.Tool)
	set(ParamPolicyVersion, f.PolicyVersion)
	set(ParamDecision, f.Decision)
	set(ParamRole, f.Role)
	set(ParamApprover, f.Approver)
	set(ParamApprovalID, f.ApprovalID)
	set(ParamCallID, f.CallID)
	set(ParamTraceID, f.TraceID)
	set(ParamToolDigest, f.ToolDigest)
	set(ParamState, string(f.State))
	if !f.Since.IsZero() {
		v.Set(ParamSince, f.Since.UTC().Format(time.RFC3339Nano))
	}
	if !f.Until.IsZero() {
		v.Set(ParamUntil, f.Until.UTC().Format(time.RFC3339Nano))
	}
	if f.Limit != 0 {
		v.Set(ParamLimit, strconv.Itoa(f.Limit))
	}
	return v
}

// known is every parameter FilterFromValues reads; others are refused, so
// that a misspelt filter cannot silently widen a question.
var known = map[string]bool{
	ParamTenant: true, ParamAllTenants: true, ParamJTI: true, ParamCredentialFamily: true,
	ParamTool: true, ParamPolicyVersion: true, ParamDecision: true, ParamRole: true, ParamApprover: true,
	ParamApprovalID: true, ParamCallID: true, ParamTraceID: true, ParamToolDigest: true, ParamState: true,
	ParamSince: true, ParamUntil: true, ParamLimit: true,
}

// FilterFromValues reads a Filter from query parameters. Times are RFC
// 3339, or a duration ("2h", "90m") meaning that long before now. extra
// names further parameters the caller reads itself (such as bucket or
// format); any other unknown parameter is an error.
func FilterFromValues(v url.Values, now time.Time, extra ...string) (Filter, error) {
	var f Filter
	for k, vs := range v {
		if !known[k] && !slices.Contains(extra, k) {
			return f, fmt.Errorf("%w: unknown parameter %q", ErrInvalidFilter, k)
		}
		if len(vs) > 1 {
			return f, fmt.Errorf("%w: parameter %q given %d times", ErrInvalidFilter, k, len(vs))
		}
	}
	f.Tenant = v.Get(ParamTenant)
	if s := v.Get(ParamAllTenants); s != "" {
		b, err := strconv.ParseBool(s)
		if err != nil {
			return f, fmt.Errorf("%w: %s=%q is not true or false", ErrInvalidFilter, ParamAllTenants, s)
		}
		f.AllTenants = b
	}
	f.JTI = v.Get(ParamJTI)
	f.CredentialFamily = v.Get(ParamCredentialFamily)
	f.Tool = v.Get(ParamTool)
	f.PolicyVersion = v.Get(ParamPolicyVersion)
	f.Decision = v.Get(ParamDecision)
	f.Role = v.Get(ParamRole)
	f.Approver = v.Get(ParamApprover)
	f.ApprovalID = v.Get(ParamApprovalID)
	f.CallID = v.Get(ParamCallID)
	f.TraceID = v.Get(ParamTraceID)
	f.ToolDigest = v.Get(ParamToolDigest)
	// Check says whether the state is one the machine knows.
	f.State = statemachine.State(v.Get(ParamState))
	var err error
	if f.Since, err = ParseTime(v.Get(ParamSince), now); err != nil {
		return f, fmt.Errorf("%w: %s: %v", ErrInvalidFilter, ParamSince, err)
	}
	if f.Until, err = ParseTime(v.Get(ParamUntil), now); err != nil {
		return f, fmt.Errorf("%w: %s: %v", ErrInvalidFilter, ParamUntil, err)
	}
	if s := v.Get(ParamLimit); s != "" {
		if f.Limit, err = strconv.Atoi(s); err != nil {
			return f, fmt.Errorf("%w: %s=%q is not a number", ErrInvalidFilter, ParamLimit, s)
		}
	}
	return f, nil
}

// ParseTime reads a time as RFC 3339 ("2026-11-30T14:02:00Z"), or as a
// duration before now ("2h", "15m", or whole days: "7d"). Empty is the
// zero time.
func ParseTime(s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if n, ok := strings.CutSuffix(s, "d"); ok {
		// Days, which incident questions ask in ("since 7d") and Go's
		// durations do not know.
		if days, err := strconv.Atoi(n); err == nil && days >= 0 && days <= maxDays {
			return now.Add(-time.Duration(days) * 24 * time.Hour).UTC(), nil
		}
	}
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("%q: a duration means that long ago, and cannot be negative", s)
		}
		return now.Add(-d).UTC(), nil
	}
	t, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("%q is neither an RFC 3339 time nor a duration such as 2h or 7d", s)
	}
	return t.UTC(), nil
}

// maxDays bounds a duration in days: as a time.Duration, ParseTime's
// past, at most some 290 years.
const maxDays = 100_000

// ParseBucket reads an Outcomes bucket: a duration, default 5m.
func ParseBucket(s string) (time.Duration, error) {
	if s == "" {
		return 5 * time.Minute, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf("%w: bucket %q is not a duration such as 5m", ErrInvalidFilter, s)
	}
	return d, nil
}
