// Package policy is the ledger's policy decision point: it decides, with
// Cedar (github.com/cedar-policy/cedar-go), whether a caller may run a tool
// call, and with which obligations. The intake is the enforcement point; it
// builds a Request from the verified identity, the registry and the
// arguments, and records the Decision on the call's decision event.
//
// # The Cedar model
//
// This is the contract policy authors write against.
//
// Principal: User::"<tenant>/<user>", with attributes
//
//	tenant  String       the caller's tenant (from the identity assertion)
//	roles   Set<String>  the caller's roles (the assertion's roles claim),
//	                     only when the engine gives roles (Config.Roles,
//	                     `--policy-roles`); without it a policy that reads
//	                     roles fails closed (policy_error), and one that
//	                     asks `principal has roles` is told no
//
// A compensation is decided as the operator who asked for it (their staff
// assertion's roles), or, asked for by the reconciler itself
// (undo_unknown), as User::"<tenant>/ledger-reconciler" with the roles
// ["operator"].
//
// Action: Action::"tool::<tool name>", such as Action::"tool::refund_order".
// Actions have no parents; `action in [...]` is a list of names.
//
// Resource: Resource::"<resource tenant>/<id>", where id is the value of the
// tool's registry resource pointer in the arguments ("ord_1029"), or the tool
// name when the tool names no resource. Attributes:
//
//	tenant  String  the tenant that owns the resource
//	kind    String  "object" (an id from the arguments) or "tool"
//
// Context, a record with every key always present:
//
//	tenant        String   the caller's tenant
//	agent         String   the acting agent (the assertion's act)
//	purpose       String   the declared purpose, "" when none
//	amount        Long     amount_cents as given: the currency's minor unit; 0 when the tool has none
//	has_amount    Bool     whether amount is meaningful (a call whose
//	                       amount_cents is there but not an integer is
//	                       denied invalid_request before any policy runs)
//	risk          String   the tool's risk: "low", "medium", "high"
//	effect        String   the tool's effect: "read", "write", "external_side_effect"
//	channel       String   how the call arrived: "kafka" for an agent's envelope
//	                       (from the request topic, published through the API
//	                       or not; ledger dev's too), "compensation" for a
//	                       compensation the ledger asks for itself
//	tool          String   the tool name
//	tool_version  Long     the tool version
//	time          Long     decision time, Unix seconds
//	hour          Long     hour of the day of time, UTC (0-23)
//	arguments     Record   the top-level string, integer and bool arguments
//	                       (an integer however spelt: 5000, 5e3, 5000.0);
//	                       nested values, nulls and non-integers are absent,
//	                       so guard optional ones with `has`
//
// Entities passed to Cedar are the principal and the resource only.
//
// # Decisions
//
// Cedar's rule applies (a matching forbid beats any permit; no matching
// permit is a denial) with the engine failing closed around it: no active
// set, an invalid request, a resource of another tenant (checked before
// Cedar runs), any evaluation error in any policy, a panic, or a decision
// later than Config.Timeout all deny, each with its own Decision.Reason.
// Of those, a timeout and no active set are Decision.Transient: the
// engine could not decide, so its callers refuse the call for now
// (nothing runs) without recording a final denial. An evaluation error
// (policy_error) is a final denial: a policy that cannot evaluate a
// call's request (a missing attribute, a type error) gives it every time
// it is asked, so a retry would only be refused again.
//
// # Policy ids and obligations
//
// A policy's id is its @id("...") annotation, unique in the set; without
// one it is "<file>:policy<n>", n counting the file's policies from 0.
// Obligations are annotations, read only from the permits that decide an
// allow (annotations on forbids and on policies that did not match have no
// effect):
//
//	@obligation("require_approval")   a human approves first
//	@obligation("sandbox"), @sandbox  run against a sandbox backend, which
//	                                  no call does yet: the call is denied
//	                                  sandbox_unavailable (fail closed)
//	                                  (@sandbox("true") also; "false" is off)
//	@mask("/reason, card_number")     comma-separated JSON pointers or bare
//	                                  field names, masked in results and in
//	                                  the audit copy of the arguments
//	@rate_limit("20/m")               n per s, m or h, per tenant and tool
//	                                  (a token bucket: a burst of n, then
//	                                  one every period/n; processors.GCRA)
//	                                  for the calls this policy decides:
//	                                  each policy's limit is a budget of
//	                                  its own; "20/m by user" ("by
//	                                  agent") makes it each verified
//	                                  user's (agent's) budget
//
// When several permits decide, their obligations add up: any approval or
// sandbox applies, masks are united, and every rate limit applies: the
// call is charged to each deciding policy's budget, or refused while any
// of them is spent (and then charged to none). An unknown obligation or a
// malformed value fails the load of the whole set, since an ignored typo
// would weaken a rule.
//
// @mask is also read another way, since a denial carries no obligations
// and a denied call's arguments are as sensitive as an allowed one's: the
// audit copy of a call's arguments (the requested event, and all that is
// built from it) hides every field that any policy of the set, permit or
// forbid, matching or not, masks for the call's tool
// (Decision.AuditMask), whatever the decision. A policy's tools are read
// from its action scope when the set loads; a scope that names no action
// counts for every tool, and conditions are not read.
//
// # Versions
//
// A Set is the *.cedar files of one directory, labelled by the operator
// ("v41") and hashed over file names and contents; its Version
// ("v41@3f2a9c1b0d7e") is on every decision. Engine.Swap, Engine.Reload and
// Engine.WatchDir change the active set at run time; a set that fails to
// load never replaces the active one. Engine.FollowActivations follows the
// version an operator activates on the control plane, which wins over the
// directory for as long as it is in force; an activated version that does
// not load denies every call until it does (Engine.Err says why), since
// the set it was meant to replace is no longer the operator's policy.
//
// The embedded demo set (Demo, files demo/*.cedar) is what `ledger dev` and
// the tests use.
package policy
