package schemas

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/santhosh-tekuri/jsonschema/v5"
)

// Defaults applied by Load to registry fields that a file leaves out (or sets
// to zero).
const (
	DefaultTimeout        = 10 * time.Second
	DefaultMaxConcurrency = 16
	DefaultMaxResultBytes = 64 << 10
)

// SchemaBaseURL is the prefix of every schema $id this package assigns. The
// URLs are identifiers only: nothing is ever fetched from them.
const SchemaBaseURL = "https://schemas.toolcall-ledger.dev/"

// Effect says what running a tool does to the world.
type Effect string

// The effects a registry entry may declare.
const (
	// EffectRead only reads; running it twice is harmless.
	EffectRead Effect = "read"
	// EffectWrite changes state the ledger's operator owns.
	EffectWrite Effect = "write"
	// EffectExternalSideEffect changes the world outside (money, mail):
	// the ledger must run it at most once per call.
	EffectExternalSideEffect Effect = "external_side_effect"
)

// Valid reports whether e is one of the declared effects.
func (e Effect) Valid() bool {
	switch e {
	case EffectRead, EffectWrite, EffectExternalSideEffect:
		return true
	}
	return false
}

// Risk is the tool owner's rating, an input to policy.
type Risk string

// The risk levels a registry entry may declare.
const (
	RiskLow    Risk = "low"
	RiskMedium Risk = "medium"
	RiskHigh   Risk = "high"
)

// Valid reports whether r is one of the declared risk levels.
func (r Risk) Valid() bool {
	switch r {
	case RiskLow, RiskMedium, RiskHigh:
		return true
	}
	return false
}

// Idempotency says who makes a retried call safe.
type Idempotency string

// The idempotency modes a registry entry may declare.
const (
	// IdempotencyNative: the backend dedupes on the Idempotency-Key it
	// receives, so the executor may retry with the same key.
	IdempotencyNative Idempotency = "native"
	// IdempotencyGateway: a gateway in front of the backend dedupes on the
	// key; for the ledger it behaves like native.
	IdempotencyGateway Idempotency = "gateway"
	// IdempotencyNone: nothing downstream dedupes; a call whose attempt may
	// have reached the backend goes to outcome_unknown, never to a retry.
	IdempotencyNone Idempotency = "none"
)

// Valid reports whether i is one of the declared idempotency modes.
func (i Idempotency) Valid() bool {
	switch i {
	case IdempotencyNative, IdempotencyGateway, IdempotencyNone:
		return true
	}
	return false
}

// BackendHTTP is the only backend kind so far.
const BackendHTTP = "http"

// Backend says where a tool runs.
type Backend struct {
	// Kind is the adapter; only "http" exists.
	Kind string `json:"kind"`
	// URL is the endpoint the executor POSTs the arguments to. It may be
	// relative ("/tools/refund_order"): the executor resolves it against
	// its configured base URL.
	URL string `json:"url"`
	// Audience is the aud of the per-call credential minted for the call.
	Audience string `json:"audience"`
	// SecretRef names a long-lived secret the backend demands (an API key
	// of a third party, say), kept in the executor's keystore and sent
	// only to the backend, as the X-Backend-Secret header. Empty: none.
	SecretRef string `json:"secret_ref,omitempty"`
	// CredentialSkewMS is how long past a per-call credential's expiry
	// the backend's verifier still accepts it, when that is longer than
	// the ledger's own assumption (credentials.DefaultSkew, 30 s): a
	// paused executor's request can land that late, so the reconciler
	// waits as long before it takes a status lookup's not_found as
	// final. 0 or absent: the assumption. At most MaxCredentialSkew.
	CredentialSkewMS int64 `json:"credential_skew_ms,omitempty"`
}

// MaxCredentialSkew bounds Backend.CredentialSkewMS: a verifier that
// accepts credentials longer past their expiry is not bounding them.
const MaxCredentialSkew = time.Hour

// CredentialSkew is CredentialSkewMS as a duration.
func (b Backend) CredentialSkew() time.Duration {
	return time.Duration(b.CredentialSkewMS) * time.Millisecond
}

// StatusLookup is how the reconciler asks a backend whether a call whose
// outcome is unknown happened.
type StatusLookup struct {
	// URL is fetched with GET, keyed by the call's idempotency key; like
	// Backend.URL it may be relative to the executor's base URL.
	URL string `json:"url"`
}

// ResourceVersion is how to read a resource's version; like Backend.URL
// the URL may be relative to the executor's base URL.
type ResourceVersion struct {
	URL string `json:"url"`
	// IfMatch: the tool honours If-Match on its calls with the versions
	// URL answers, refusing (412) to act on the resource at another. An
	// approved call then sends the approved version, which closes the
	// window between the executor's last read and the effect. Without
	// it nothing is sent: a tool checking If-Match against tags of its
	// own would refuse every approved call.
	IfMatch bool `json:"if_match,omitempty"`
}

// ToolRef names one version of a tool, such as a compensation tool.
type ToolRef struct {
	Tool    string `json:"tool"`
	Version int    `json:"version"`
}

// String returns "<tool>.v<version>".
func (r ToolRef) String() string { return r.Tool + ".v" + strconv.Itoa(r.Version) }

// Tool is one version of one tool in the registry (DESIGN §6), read from
// tools/<name>.v<version>.json. A *Tool returned by a Registry is immutable
// and safe for concurrent use; its input schema was compiled once, at load.
type Tool struct {
	// Name matches ^[a-z][a-z0-9_]{0,63}$ and the file name.
	Name string `json:"name"`
	// Version is >= 1 and matches the file name.
	Version int `json:"version"`
	// Owner is the team answerable for the tool.
	Owner string `json:"owner"`
	// Description is for approvers and operators.
	Description string `json:"description"`
	// InputSchema is the JSON Schema (draft 2020-12) of the arguments
	// object. Its top level must say "additionalProperties": false.
	InputSchema json.RawMessage `json:"input_schema"`
	// Effect, Risk and Idempotency are required and must be valid.
	Effect      Effect      `json:"effect"`
	Risk        Risk        `json:"risk"`
	Idempotency Idempotency `json:"idempotency"`
	// TimeoutMS bounds one attempt; 0 or absent means DefaultTimeout.
	// The call's own deadline, when shorter, wins.
	TimeoutMS int64 `json:"timeout_ms,omitempty"`
	// MaxConcurrency is the tool's bulkhead: attempts in flight per
	// executor; 0 or absent means DefaultMaxConcurrency.
	MaxConcurrency int `json:"max_concurrency,omitempty"`
	// MaxResultBytes caps the result kept from the backend; 0 or absent
	// means DefaultMaxResultBytes.
	MaxResultBytes int `json:"max_result_bytes,omitempty"`
	// Redact lists JSON pointers into the arguments (or bare field names,
	// meaning that key at any depth) whose values events never show.
	Redact []string `json:"redact,omitempty"`
	// Mask lists result fields (pointers or bare names, as Redact) masked
	// before a result leaves the executor.
	Mask []string `json:"mask,omitempty"`
	// Backend is required.
	Backend Backend `json:"backend"`
	// StatusLookup is optional; without it an unknown outcome goes to
	// compensation or to a human.
	StatusLookup *StatusLookup `json:"status_lookup,omitempty"`
	// Compensation is optional; when set it must name a tool version in
	// the same registry.
	Compensation *ToolRef `json:"compensation,omitempty"`
	// Resource is an optional JSON pointer into the arguments naming the
	// resource the call touches ("/order_id"), for policy and blast radius.
	Resource string `json:"resource,omitempty"`
	// ResourceVersion, optional, says how to read the resource's version:
	// a GET of URL?resource=<value> answering {"version": "..."}. An
	// approval binds the version the approver saw, and an approved call
	// whose resource changed since is denied (resource_changed).
	ResourceVersion *ResourceVersion `json:"resource_version,omitempty"`

	schema *jsonschema.Schema
	digest string
}

// Digest identifies the definition: "sha256:" and the hex SHA-256 of the
// entry as loaded (its fields in a fixed order, defaults filled in, the
// input schema's members sorted and its numbers written one way), so
// that a file laid out or spelt another way has the same digest and any
// other change gives another (reordering an array is a change: the
// order of some means something). A call is admitted under its tool's
// digest, and every process that acts on the call takes its tool only
// from a registry whose definition has that digest (Registry.Bound): a
// version is immutable, and a changed definition is a new version.
func (t *Tool) Digest() string { return t.digest }

// definitionDigest computes t's Digest, once its defaults are filled in.
func definitionDigest(t *Tool) (string, error) {
	// The input schema is kept as written; members sorted and numbers
	// written one way, a reformatted file keeps its digest (arrays keep
	// their order: prefixItems' is meaningful).
	dec := json.NewDecoder(bytes.NewReader(t.InputSchema))
	dec.UseNumber()
	var schema any
	if err := dec.Decode(&schema); err != nil {
		return "", err
	}
	sorted, err := json.Marshal(exactNumbers(schema))
	if err != nil {
		return "", err
	}
	entry := *t
	entry.InputSchema = sorted
	b, err := json.Marshal(&entry)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return "sha256:" + hex.EncodeToString(sum[:]), nil
}

// exactNumbers returns v, a tree json.Decoder made with UseNumber, with
// each number written one way for its exact value: 1e3, 1000 and 1000.0
// alike as 1000, 0.50 as 0.5. Not through float64, which would write
// 9007199254740993 as 9007199254740992 though the validator tells them
// apart. A number with an exponent of more than maxExactExponent digits'
// worth stays as written, rather than spelt out in full.
func exactNumbers(v any) any {
	switch v := v.(type) {
	case map[string]any:
		for k, e := range v {
			v[k] = exactNumbers(e)
		}
	case []any:
		for i, e := range v {
			v[i] = exactNumbers(e)
		}
	case json.Number:
		return exactNumber(v)
	}
	return v
}

// maxExactExponent bounds the exponents exactNumber spells out.
const maxExactExponent = 400

// exactNumber writes n as a decimal without exponent, without leading
// zeros in its integer part or trailing zeros in its fraction.
func exactNumber(n json.Number) json.Number {
	s := string(n)
	if i := strings.IndexAny(s, "eE"); i >= 0 {
		if e, err := strconv.Atoi(strings.TrimPrefix(s[i+1:], "+")); err != nil || e > maxExactExponent || e < -maxExactExponent {
			return n
		}
	}
	r, ok := new(big.Rat).SetString(s)
	if !ok {
		return n
	}
	// A decimal's denominator is 2^a 5^b: max(a, b) fraction digits
	// write it exactly.
	digits := 0
	d := new(big.Int).Set(r.Denom())
	for _, p := range []int64{2, 5} {
		count, q, m, bp := 0, new(big.Int), new(big.Int), big.NewInt(p)
		for {
			q.QuoRem(d, bp, m)
			if m.Sign() != 0 {
				break
			}
			d.Set(q)
			count++
		}
		digits = max(digits, count)
	}
	return json.Number(r.FloatString(digits))
}

// Ref returns the tool's name and version.
func (t *Tool) Ref() ToolRef { return ToolRef{Tool: t.Name, Version: t.Version} }

// Timeout returns the per-attempt timeout.
func (t *Tool) Timeout() time.Duration { return time.Duration(t.TimeoutMS) * time.Millisecond }

// SchemaID returns the absolute $id the tool's input schema is compiled
// under, the Schema of its validation errors.
func (t *Tool) SchemaID() string { return ToolSchemaID(t.Name, t.Version) }

// ToolSchemaID returns the $id of the input schema of tool name at version.
func ToolSchemaID(name string, version int) string {
	return SchemaBaseURL + "tools/" + name + ".v" + strconv.Itoa(version) + ".json"
}

// Validate checks a decoded arguments tree (map[string]any, []any, string,
// json.Number, bool or nil, as ledger.Decode makes them) against the tool's
// input schema. It compiles nothing. A failure is a *ValidationError whose
// Pointer is relative to the arguments object ("/amount_cents").
func (t *Tool) Validate(args any) error {
	return validate(t.schema, t.SchemaID(), args)
}

var toolNameRE = regexp.MustCompile(`^[a-z][a-z0-9_]{0,63}$`)

// ErrInvalidTool is wrapped by every error about a malformed registry file.
var ErrInvalidTool = errors.New("invalid tool definition")

// check validates the fields that need no compilation and fills defaults.
func (t *Tool) check() error {
	var problems []string
	bad := func(format string, a ...any) { problems = append(problems, fmt.Sprintf(format, a...)) }

	if !toolNameRE.MatchString(t.Name) {
		bad("name %q must match %s", t.Name, toolNameRE)
	}
	if t.Version < 1 {
		bad("version %d must be >= 1", t.Version)
	}
	if len(t.InputSchema) == 0 {
		bad("input_schema is required")
	}
	if !t.Effect.Valid() {
		bad("effect %q must be read, write or external_side_effect", t.Effect)
	}
	if !t.Risk.Valid() {
		bad("risk %q must be low, medium or high", t.Risk)
	}
	if !t.Idempotency.Valid() {
		bad("idempotency %q must be native, gateway or none", t.Idempotency)
	}
	if t.TimeoutMS < 0 {
		bad("timeout_ms %d must not be negative", t.TimeoutMS)
	}
	if t.Backend.CredentialSkewMS < 0 || t.Backend.CredentialSkew() > MaxCredentialSkew {
		bad("backend.credential_skew_ms %d must be between 0 and %d", t.Backend.CredentialSkewMS, MaxCredentialSkew.Milliseconds())
	}
	if t.MaxConcurrency < 0 {
		bad("max_concurrency %d must not be negative", t.MaxConcurrency)
	}
	if t.MaxResultBytes < 0 {
		bad("max_result_bytes %d must not be negative", t.MaxResultBytes)
	}
	for _, p := range t.Redact {
		if !ValidRedaction(p) {
			bad("redact entry %q must be a JSON pointer or a field name", p)
		}
	}
	for _, p := range t.Mask {
		if !ValidRedaction(p) {
			bad("mask entry %q must be a JSON pointer or a field name", p)
		}
	}
	if t.Backend.Kind != BackendHTTP {
		bad("backend.kind %q must be %q", t.Backend.Kind, BackendHTTP)
	}
	if t.Backend.URL == "" {
		bad("backend.url is required")
	}
	if t.Backend.Audience == "" {
		bad("backend.audience is required")
	}
	if t.StatusLookup != nil && t.StatusLookup.URL == "" {
		bad("status_lookup.url is required when status_lookup is set")
	}
	if c := t.Compensation; c != nil && (!toolNameRE.MatchString(c.Tool) || c.Version < 1) {
		bad("compensation %q must name a tool and a version >= 1", c.String())
	}
	if t.Resource != "" && !validPointer(t.Resource) {
		bad("resource %q must be a JSON pointer such as \"/order_id\"", t.Resource)
	}
	if rv := t.ResourceVersion; rv != nil {
		// Either would leave an approval bound to no version, in
		// silence: nothing to ask, or no resource to ask about.
		if rv.URL == "" {
			bad("resource_version.url is required when resource_version is set")
		}
		if t.Resource == "" {
			bad("resource_version needs resource, the pointer to the resource whose version it reads")
		}
	}
	if len(problems) > 0 {
		return fmt.Errorf("%w: %s", ErrInvalidTool, strings.Join(problems, "; "))
	}

	if t.TimeoutMS == 0 {
		t.TimeoutMS = DefaultTimeout.Milliseconds()
	}
	if t.MaxConcurrency == 0 {
		t.MaxConcurrency = DefaultMaxConcurrency
	}
	if t.MaxResultBytes == 0 {
		t.MaxResultBytes = DefaultMaxResultBytes
	}
	return nil
}

// ValidRedaction reports whether p is what ledger.Redact applies: an RFC
// 6901 pointer, or a bare, non-empty field name. A pointer with a bad "~"
// escape would be dropped there, masking nothing.
func ValidRedaction(p string) bool {
	if strings.HasPrefix(p, "/") {
		return validPointer(p)
	}
	return p != ""
}

// ResolvePointer resolves an RFC 6901 JSON pointer in a decoded JSON
// document, through objects and arrays (an index is decimal, without
// leading zeros; "-", past the end, finds nothing): the value, and whether
// there is one. "" is the whole document.
func ResolvePointer(doc any, ptr string) (any, bool) {
	if ptr == "" {
		return doc, true
	}
	if !strings.HasPrefix(ptr, "/") {
		return nil, false
	}
	cur := doc
	for _, tok := range strings.Split(ptr[1:], "/") {
		tok = strings.ReplaceAll(strings.ReplaceAll(tok, "~1", "/"), "~0", "~")
		switch c := cur.(type) {
		case map[string]any:
			v, ok := c[tok]
			if !ok {
				return nil, false
			}
			cur = v
		case []any:
			i, err := strconv.Atoi(tok)
			if err != nil || i < 0 || i >= len(c) || strconv.Itoa(i) != tok {
				return nil, false
			}
			cur = c[i]
		default:
			return nil, false
		}
	}
	return cur, true
}

// validPointer reports whether p is a non-empty RFC 6901 pointer: it starts
// with "/" and every "~" is followed by "0" or "1".
func validPointer(p string) bool {
	if !strings.HasPrefix(p, "/") {
		return false
	}
	for i := 0; i < len(p); i++ {
		if p[i] == '~' && (i+1 >= len(p) || (p[i+1] != '0' && p[i+1] != '1')) {
			return false
		}
	}
	return true
}
