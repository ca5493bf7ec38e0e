package policy

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/cedar-policy/cedar-go"

	"github.com/toolcall-ledger/ledger/ledger"
)

// Entity types of the Cedar model; see the package documentation.
const (
	typeUser     cedar.EntityType = "User"
	typeAction   cedar.EntityType = "Action"
	typeResource cedar.EntityType = "Resource"
)

// actionToolPrefix prefixes a tool's name in its action's id:
// Action::"tool::refund_order".
const actionToolPrefix = "tool::"

// Resource kinds (resource.kind).
const (
	// KindTool: the call names no resource of its own (no registry
	// resource pointer, or an empty value); the resource is the tool.
	KindTool = "tool"
	// KindObject: the resource is the object the call's arguments name,
	// such as an order id.
	KindObject = "object"
)

// Request is what the intake knows about a call when it asks for a
// decision. Tenant and User come from the verified identity assertion,
// never from the arguments.
//
// Arguments may hold sensitive values, so Request's String, GoString and
// LogValue show only the argument names.
type Request struct {
	Tenant  string
	User    string
	Agent   string
	Purpose string
	// Roles are the caller's roles, from the verified assertion; the
	// policies see them only when the engine gives roles (Config.Roles)
	// and RolesWithheld is false: a call decided again that was decided
	// without roles (its events say none were given) is decided without
	// them again, never with an empty set.
	Roles         []string
	RolesWithheld bool
	Tool          string
	ToolVersion   int
	// Effect and Risk are the tool's registry values ("write", "high").
	Effect string
	Risk   string
	// Resource is the value of the tool's registry resource pointer in
	// the arguments, such as "ord_1029"; empty when the tool has none.
	Resource string
	// ResourceTenant is the tenant that owns the resource. It must equal
	// Tenant; anything else, empty included, is denied as cross_tenant
	// before any policy runs.
	ResourceTenant string
	// Amount is the tool's amount_cents argument, when it has one: in the
	// currency's minor unit (a yen, a thousandth of a dinar), which a
	// policy comparing amounts across currencies must look at.
	Amount *int64
	// AmountInvalid: the arguments hold an amount_cents that is not an
	// integer a Long holds; the request is denied (invalid_request)
	// before any policy runs.
	AmountInvalid bool
	// Channel is how the call arrived, such as "agent" or "api".
	Channel string
	// Arguments are the decoded arguments (map[string]any of
	// json.Number, string, bool... as ledger.Decode makes them).
	Arguments map[string]any
	// Time is when the call is decided; zero means the engine's clock.
	Time time.Time
	// AuditAlso names the tools whose masks the decision's AuditMask
	// holds too: a call that carries another call's arguments (a
	// compensation carries the undone call's) hides in its audit copy
	// what that call's hid.
	AuditAlso []string
}

// String describes r without argument values.
func (r Request) String() string {
	return fmt.Sprintf("policy.Request{tenant=%s user=%s agent=%s tool=%s.v%d resource=%s/%s arguments=%v}",
		r.Tenant, r.User, r.Agent, r.Tool, r.ToolVersion, r.ResourceTenant, r.Resource, r.argumentNames())
}

// GoString is String, so that %#v hides argument values too.
func (r Request) GoString() string { return r.String() }

// LogValue logs r without argument values.
func (r Request) LogValue() slog.Value {
	return slog.GroupValue(
		slog.String("tenant", r.Tenant),
		slog.String("user", r.User),
		slog.String("agent", r.Agent),
		slog.String("tool", r.Tool),
		slog.Int("tool_version", r.ToolVersion),
		slog.String("resource", r.Resource),
		slog.Any("argument_names", r.argumentNames()),
	)
}

func (r Request) argumentNames() []string {
	names := make([]string, 0, len(r.Arguments))
	for k := range r.Arguments {
		names = append(names, k)
	}
	slices.Sort(names)
	return names
}

// validate refuses requests the model cannot express safely.
func (r Request) validate() error {
	switch {
	case r.Tenant == "":
		return fmt.Errorf("missing tenant")
	case r.User == "":
		return fmt.Errorf("missing user")
	case r.Tool == "":
		return fmt.Errorf("missing tool")
	case strings.Contains(r.Tenant, "/"):
		// The tenant prefixes entity ids ("<tenant>/<user>"); a slash
		// in it could make two tenants' ids collide.
		return fmt.Errorf("tenant contains '/'")
	case r.AmountInvalid:
		return fmt.Errorf("amount_cents is not an integer of the currency's minor unit (at most %d): no policy's amount rule could be applied to it", int64(math.MaxInt64))
	}
	return nil
}

// entities holds the two entities of a request: a fixed-size getter, so
// that a decision builds no map of entities.
type entities struct {
	principal, resource cedar.Entity
}

// Get returns the principal or the resource; every other entity (actions
// included) does not exist.
func (e *entities) Get(uid cedar.EntityUID) (cedar.Entity, bool) {
	switch uid {
	case e.principal.UID:
		return e.principal, true
	case e.resource.UID:
		return e.resource, true
	}
	return cedar.Entity{}, false
}

// cedarRequest maps r onto the Cedar model described in the package
// documentation; the principal has the roles attribute unless r withholds
// them.
func cedarRequest(r Request, now time.Time) (cedar.Request, *entities) {
	resID, kind := r.Resource, KindObject
	if resID == "" {
		resID, kind = r.Tool, KindTool
	}
	principal := cedar.NewEntityUID(typeUser, cedar.String(r.Tenant+"/"+r.User))
	resource := cedar.NewEntityUID(typeResource, cedar.String(r.ResourceTenant+"/"+resID))
	attrs := cedar.RecordMap{"tenant": cedar.String(r.Tenant)}
	if !r.RolesWithheld {
		set := make([]cedar.Value, len(r.Roles))
		for i, role := range r.Roles {
			set[i] = cedar.String(role)
		}
		attrs["roles"] = cedar.NewSet(set...)
	}
	ents := &entities{
		principal: cedar.Entity{
			UID:        principal,
			Attributes: cedar.NewRecord(attrs),
		},
		resource: cedar.Entity{
			UID: resource,
			Attributes: cedar.NewRecord(cedar.RecordMap{
				"tenant": cedar.String(r.ResourceTenant),
				"kind":   cedar.String(kind),
			}),
		},
	}
	t := r.Time
	if t.IsZero() {
		t = now
	}
	t = t.UTC()
	var amount int64
	if r.Amount != nil {
		amount = *r.Amount
	}
	ctx := cedar.RecordMap{
		"tenant":       cedar.String(r.Tenant),
		"agent":        cedar.String(r.Agent),
		"purpose":      cedar.String(r.Purpose),
		"amount":       cedar.Long(amount),
		"has_amount":   cedar.Boolean(r.Amount != nil),
		"risk":         cedar.String(r.Risk),
		"effect":       cedar.String(r.Effect),
		"channel":      cedar.String(r.Channel),
		"tool":         cedar.String(r.Tool),
		"tool_version": cedar.Long(r.ToolVersion),
		"time":         cedar.Long(t.Unix()),
		"hour":         cedar.Long(t.Hour()),
		"arguments":    argumentsRecord(r.Arguments),
	}
	return cedar.Request{
		Principal: principal,
		Action:    cedar.NewEntityUID(typeAction, cedar.String(actionToolPrefix+r.Tool)),
		Resource:  resource,
		Context:   cedar.NewRecord(ctx),
	}, ents
}

// argumentsRecord keeps the top-level string, integer (however spelt)
// and bool arguments.
// Nested objects and arrays, nulls, and numbers that are not integers in
// int64 range are left out: a policy that reads one finds it missing
// (check with `has`), rather than a lossy conversion.
func argumentsRecord(args map[string]any) cedar.Record {
	if len(args) == 0 {
		return cedar.NewRecord(nil)
	}
	m := make(cedar.RecordMap, len(args))
	for k, v := range args {
		if cv, ok := cedarValue(v); ok {
			m[cedar.String(k)] = cv
		}
	}
	return cedar.NewRecord(m)
}

func cedarValue(v any) (cedar.Value, bool) {
	switch v := v.(type) {
	case string:
		return cedar.String(v), true
	case bool:
		return cedar.Boolean(v), true
	case json.Number:
		// Whatever its spelling: 5e3 and 5000.0 are 5000, as the
		// tools' JSON Schema integer takes them. Read as ParseInt
		// does, they were left out, and a forbid guarded with `has`
		// passed them by.
		if n, ok := ledger.Integer(v); ok {
			return cedar.Long(n), true
		}
	case int:
		return cedar.Long(v), true
	case int32:
		return cedar.Long(v), true
	case int64:
		return cedar.Long(v), true
	case float64:
		if v == math.Trunc(v) && v >= math.MinInt64 && v < math.MaxInt64 {
			return cedar.Long(int64(v)), true
		}
	}
	return nil, false
}
