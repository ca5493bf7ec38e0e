package ledger

import (
	"encoding/base64"
	"fmt"
	"strings"
)

// UnverifiedTenant is the reserved tenant under which the intake files
// refusals of envelopes whose sender it could not verify (unreadable, or
// with an assertion it refused): they never land in the key space of the
// tenant such an envelope merely claims. Real tenant ids cannot start with
// "_" (the envelope schema says so).
const UnverifiedTenant = "_unverified"

// CallKey identifies a call: the tenant and the caller's idempotency key.
// Every dedupe record, Kafka record key and lookup uses both, so one tenant
// can never hit or read another tenant's call.
type CallKey struct {
	TenantID       string
	IdempotencyKey string
}

// String is the Kafka record key, "<tenant_id>/<idempotency_key>". Tenant ids
// cannot contain "/" (the envelope schema forbids it), so the first "/"
// separates the two.
func (k CallKey) String() string { return k.TenantID + "/" + k.IdempotencyKey }

// ParseCallKey is the inverse of CallKey.String.
func ParseCallKey(s string) (CallKey, error) {
	tenant, key, ok := strings.Cut(s, "/")
	if !ok || tenant == "" || key == "" {
		return CallKey{}, fmt.Errorf("call key %q: want <tenant_id>/<idempotency_key>", s)
	}
	return CallKey{TenantID: tenant, IdempotencyKey: key}, nil
}

// ApprovalID is the id of the call's approval: one per call, derived from
// its key so that every processor names it alike.
func (k CallKey) ApprovalID() string {
	return "apr_" + base64.RawURLEncoding.EncodeToString([]byte(k.String()))
}

// ParseApprovalID is the inverse of CallKey.ApprovalID.
func ParseApprovalID(id string) (CallKey, error) {
	raw, ok := strings.CutPrefix(id, "apr_")
	if !ok {
		return CallKey{}, fmt.Errorf("approval id %q: want apr_<base64url>", id)
	}
	b, err := base64.RawURLEncoding.DecodeString(raw)
	if err != nil {
		return CallKey{}, fmt.Errorf("approval id %q: %v", id, err)
	}
	return ParseCallKey(string(b))
}

// compensationSuffix marks the key of a compensation call.
const compensationSuffix = ":compensate"

// CompensationKey is the key of the call that undoes k: its own call, with
// its own key derived from k's, so that asking twice runs it once.
func (k CallKey) CompensationKey() CallKey {
	return CallKey{TenantID: k.TenantID, IdempotencyKey: k.IdempotencyKey + compensationSuffix}
}

// Compensates returns the call that the compensation call k undoes, if k
// is one.
func (k CallKey) Compensates() (CallKey, bool) {
	orig, ok := strings.CutSuffix(k.IdempotencyKey, compensationSuffix)
	if !ok || orig == "" {
		return CallKey{}, false
	}
	return CallKey{TenantID: k.TenantID, IdempotencyKey: orig}, true
}
