// Package control is the ledger's control plane (DESIGN.md §5, Control):
// the kill switch and credential revocations, kept as records on the
// compacted control topic (ledger.Topics.Control), keyed by subject.
//
// Subjects:
//
//	tool:<name>             a freeze of a tool for every tenant
//	tool:<name>@<tenant>    a freeze of a tool for one tenant
//	jti:<jti>               a revoked credential
//	family:<family>         a revoked credential family, "<tool>:<tenant>:<key epoch>"
//
// Each record's value is an Action in JSON: what was done, to what, by
// which operator and why. Compaction keeps the latest Action per subject.
// An unfreeze is a record of its own under the freeze's subject (not a
// tombstone), so that who lifted a freeze and why stays on the topic. A
// revocation is permanent: there is no un-revoke.
//
// State rebuilds the current freezes and revocations from the topic and
// keeps them live; intake, executor and the introspection endpoint look
// them up on every call. Service is the operator API that writes them, and
// serves the RFC 7662 introspection endpoint that tool backends ask
// whether a credential is still active.
//
// File map: action.go (Action, subjects, validation), state.go (State),
// service.go (Service, Config, authorization), http.go (Handler,
// introspection).
package control

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/toolcall-ledger/ledger/ledger"
)

// ActionVersion is the V of the Actions this package writes.
const ActionVersion = 1

// The kinds of Action.
const (
	// KindFreeze stops a tool: intake denies new calls and the executor
	// denies authorized calls not yet started.
	KindFreeze = "freeze"
	// KindUnfreeze lifts the freeze under the same subject.
	KindUnfreeze = "unfreeze"
	// KindRevoke revokes a credential (JTI) or a credential family
	// (Family), for good.
	KindRevoke = "revoke"
	// KindActivatePolicy makes Policy the policy version every intake and
	// executor decides with.
	KindActivatePolicy = "activate_policy"
	// KindWithdrawPolicy ends the activation in force (Policy names the
	// version it was of, Lifts its time): every role decides with its
	// --policy-dir again. Older builds ignore this kind.
	KindWithdrawPolicy = "withdraw_policy"
)

// PolicySubject is the one subject of policy activations: the compacted
// topic keeps the latest.
const PolicySubject = "policy:active"

// Subject prefixes.
const (
	subjectTool   = "tool:"
	subjectJTI    = "jti:"
	subjectFamily = "family:"
)

// Limits on what an Action may carry.
const (
	// MaxReasonBytes bounds Action.Reason.
	MaxReasonBytes = 1024
	// MaxIDBytes bounds a tenant, a jti and a family.
	MaxIDBytes = 256
)

// toolNameRE is the registry's tool name syntax (schemas' toolNameRE).
var toolNameRE = regexp.MustCompile(`^[a-z][a-z0-9_]{0,63}$`)

// policyHashRE is a policy set's hash (policy.Set.Hash).
var policyHashRE = regexp.MustCompile(`^sha256:[0-9a-f]{64}$`)

// Action is one control record: a freeze, an unfreeze, a revocation or a
// policy activation, with who did it and why. Its wire form is the
// ledger's (ledger.ControlAction), so that projections read the control
// topic without this package.
type Action = ledger.ControlAction

// FrozenDetail is what a call refused for the freeze a says of it: the
// tool, whether the freeze is the tenant's or every tenant's, and since
// when. Not who froze it nor why: the refusal reaches the agent, and so
// the model, and a platform operator's reason may speak of other
// tenants. Operators read both from the control topic (control show).
func FrozenDetail(tool string, a Action) string {
	scope := "for every tenant"
	if a.Tenant != "" {
		scope = "for this tenant"
	}
	return fmt.Sprintf("%s is frozen %s since %s", tool, scope, a.Made().UTC().Format(time.RFC3339))
}

// ToolSubject is the subject of a freeze of tool: for every tenant when
// tenant is empty, else for that tenant only.
func ToolSubject(tool, tenant string) string {
	if tenant == "" {
		return subjectTool + tool
	}
	return subjectTool + tool + "@" + tenant
}

// JTISubject is the subject of the revocation of one credential.
func JTISubject(jti string) string { return subjectJTI + jti }

// FamilySubject is the subject of the revocation of a credential family.
func FamilySubject(family string) string { return subjectFamily + family }

// subjectOf derives the subject from the Action's fields.
func subjectOf(a Action) string {
	switch {
	case a.Kind == KindActivatePolicy, a.Kind == KindWithdrawPolicy:
		return PolicySubject
	case a.Kind == KindRevoke && a.JTI != "":
		return JTISubject(a.JTI)
	case a.Kind == KindRevoke:
		return FamilySubject(a.Family)
	default:
		return ToolSubject(a.Tool, a.Tenant)
	}
}

// checkAction reports what is wrong with an Action read from the topic: a
// record whose fields do not make its key is not applied, since it could
// be meant for another subject than the one it would change.
func checkAction(a Action, key string) error {
	switch a.Kind {
	case KindFreeze, KindUnfreeze:
		if a.Tool == "" || a.JTI != "" || a.Family != "" {
			return errors.New("a freeze names a tool and no credential")
		}
	case KindRevoke:
		if (a.JTI == "") == (a.Family == "") || a.Tool != "" || a.Tenant != "" {
			return errors.New("a revocation names exactly one of jti and family")
		}
	case KindActivatePolicy:
		if a.Policy == "" || a.Tool != "" || a.JTI != "" || a.Family != "" {
			return errors.New("an activation names a policy version and nothing else")
		}
	case KindWithdrawPolicy:
		if a.Tool != "" || a.JTI != "" || a.Family != "" {
			return errors.New("a withdrawal names at most the policy version withdrawn")
		}
	default:
		return fmt.Errorf("unknown kind %q", a.Kind)
	}
	if s := subjectOf(a); s != a.Subject || s != key {
		return fmt.Errorf("subject %q and key %q do not match the action's fields (%q)", a.Subject, key, s)
	}
	return nil
}

// ErrInvalidRequest: an operator request lacks a field or has a malformed
// one. The message says which.
var ErrInvalidRequest = errors.New("invalid request")

func checkTool(tool string) error {
	if !toolNameRE.MatchString(tool) {
		return fmt.Errorf("%w: tool must match %s", ErrInvalidRequest, toolNameRE)
	}
	return nil
}

// checkID checks a tenant, jti or family: printable, without spaces, and
// short; it may not contain any of the characters in forbidden.
func checkID(field, v, forbidden string) error {
	switch {
	case v == "":
		return fmt.Errorf("%w: %s is required", ErrInvalidRequest, field)
	case len(v) > MaxIDBytes:
		return fmt.Errorf("%w: %s is longer than %d bytes", ErrInvalidRequest, field, MaxIDBytes)
	case !utf8.ValidString(v):
		return fmt.Errorf("%w: %s is not UTF-8", ErrInvalidRequest, field)
	case strings.ContainsAny(v, forbidden):
		return fmt.Errorf("%w: %s may not contain any of %q", ErrInvalidRequest, field, forbidden)
	}
	for _, r := range v {
		if unicode.IsSpace(r) || !unicode.IsPrint(r) {
			return fmt.Errorf("%w: %s contains a space or an unprintable character", ErrInvalidRequest, field)
		}
	}
	return nil
}

// checkTenant checks the tenant of a tenant-scoped freeze. "@" would make
// the subject ambiguous, "/" cannot be in a tenant (ledger.CallKey) and
// "*" is the platform operators' tenant, not one a call runs in.
func checkTenant(tenant string) error { return checkID("tenant", tenant, "@/*") }

func checkReason(reason string) (string, error) {
	reason = strings.TrimSpace(reason)
	switch {
	case reason == "":
		return "", fmt.Errorf("%w: a reason is required", ErrInvalidRequest)
	case len(reason) > MaxReasonBytes:
		return "", fmt.Errorf("%w: reason is longer than %d bytes", ErrInvalidRequest, MaxReasonBytes)
	case !utf8.ValidString(reason):
		return "", fmt.Errorf("%w: reason is not UTF-8", ErrInvalidRequest)
	}
	return reason, nil
}

// parseFamily splits a credential family, "<tool>:<tenant>:<key epoch>"
// as processors/credentials mints it (credentials.FamilyOf). Tool names
// have no ":", the epoch is an integer, and the tenant is what lies
// between, so the split is unambiguous whatever the tenant holds.
func parseFamily(family string) (tool, tenant string, epoch int64, err error) {
	if err := checkID("family", family, ""); err != nil {
		return "", "", 0, err
	}
	tool, rest, ok := strings.Cut(family, ":")
	i := strings.LastIndexByte(rest, ':')
	if !ok || i <= 0 || !toolNameRE.MatchString(tool) {
		return "", "", 0, fmt.Errorf("%w: family must be <tool>:<tenant>:<key epoch>", ErrInvalidRequest)
	}
	tenant = rest[:i]
	if epoch, err = strconv.ParseInt(rest[i+1:], 10, 64); err != nil {
		return "", "", 0, fmt.Errorf("%w: family must be <tool>:<tenant>:<key epoch> with an integer epoch", ErrInvalidRequest)
	}
	// A family is revoked by its exact text, as minted: "+3" or "03"
	// parse as 3 and would be recorded, and shown as revoked, while no
	// credential's family matches them.
	if strconv.FormatInt(epoch, 10) != rest[i+1:] {
		return "", "", 0, fmt.Errorf("%w: family's key epoch %q is not as credentials carry it (%d)", ErrInvalidRequest, rest[i+1:], epoch)
	}
	return tool, tenant, epoch, nil
}
