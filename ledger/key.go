package ledger

import (
	"fmt"
	"strings"
)

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
