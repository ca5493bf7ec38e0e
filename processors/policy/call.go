package policy

import (
	"encoding/json"
	"time"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/schemas"
)

// Caller is who asks, from the verified identity assertion.
type Caller struct {
	Tenant, User, Agent, Purpose string
	// Roles are the assertion's roles (identity.Identity.Roles), or, for
	// a call decided again, those its events carry (Decision.Roles);
	// RolesWithheld, for a call decided again whose first decision was
	// given no roles (not Decision.RolesGiven).
	Roles         []string
	RolesWithheld bool
}

// NewRequest describes a call to the policies: who asks comes from caller
// alone; the arguments (a decoded tree, as ledger.Decode makes it) only say
// what is asked for, and a tenant or user inside them is just data. The
// intake decides with it, and the executor decides again with it before it
// runs an approved call.
func NewRequest(tool *schemas.Tool, caller Caller, arguments any, channel string, now time.Time) Request {
	args, _ := arguments.(map[string]any)
	r := Request{
		Tenant:        caller.Tenant,
		User:          caller.User,
		Agent:         caller.Agent,
		Purpose:       caller.Purpose,
		Roles:         caller.Roles,
		RolesWithheld: caller.RolesWithheld,
		Tool:          tool.Name,
		ToolVersion:   tool.Version,
		Effect:        string(tool.Effect),
		Risk:          string(tool.Risk),
		// Resources are named within the caller's tenant: an id in the
		// arguments can only ever point into it.
		ResourceTenant: caller.Tenant,
		Channel:        channel,
		Arguments:      args,
		Time:           now,
	}
	if tool.Resource != "" {
		if v, ok := ledger.ResourceOf(arguments, tool.Resource); ok {
			r.Resource = v
		}
	}
	if a, present := args["amount_cents"]; present {
		// One that is not an integer (2000000.5, "2000000", too large,
		// null; 2e6 is one) is no amount an amount rule could compare: left out,
		// the call would pass as one without an amount, past every cap
		// written `context.has_amount && context.amount > N`.
		r.AmountInvalid = true
		if n, ok := a.(json.Number); ok {
			if v, ok := ledger.Integer(n); ok {
				r.Amount, r.AmountInvalid = &v, false
			}
		}
	}
	return r
}
