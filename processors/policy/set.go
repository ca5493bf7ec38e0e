package policy

import (
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path"
	"slices"
	"strconv"
	"strings"

	"github.com/cedar-policy/cedar-go"
)

// ErrNoPolicies: a policy directory holds no *.cedar file. Loading it is an
// error rather than an empty set so that a wrong path never silently
// replaces the active policies with "deny everything".
var ErrNoPolicies = errors.New("no *.cedar policy files")

// ErrInvalidSet is wrapped by every error about a policy set that parses
// but cannot be used: a bad obligation annotation, a duplicate @id, a bad
// label.
var ErrInvalidSet = errors.New("invalid policy set")

// ParseError is a Cedar syntax error in one file. Err's message carries
// the line and column ("parse error at <input>:12:3 ...").
type ParseError struct {
	File string
	Err  error
}

// Error names the file and the position.
func (e *ParseError) Error() string { return "policy file " + e.File + ": " + e.Err.Error() }

// Unwrap returns the Cedar error.
func (e *ParseError) Unwrap() error { return e.Err }

//go:embed demo/*.cedar
var demoFS embed.FS

// DemoLabel is the label of the embedded demo set.
const DemoLabel = "demo"

// Set is one version of the policies: parsed, with its obligations read
// and checked, and named by a label and a content hash. A Set is immutable
// and safe for concurrent use.
type Set struct {
	label    string
	hash     string
	version  string
	policies []entry
	byID     map[cedar.PolicyID]*entry
	// masks are, per tool, the fields any policy of the set masks for
	// it (see auditMask); allMasks those of the policies that may apply
	// to any tool, which masks holds too.
	masks    map[string][]string
	allMasks []string
}

// entry is one policy of a set.
type entry struct {
	id          cedar.PolicyID
	policy      *cedar.Policy
	permit      bool
	obligations Obligations
	scope       policyScope
}

// Label returns the label the set was loaded under, such as "v41".
func (s *Set) Label() string { return s.label }

// Hash returns "sha256:" and the lowercase hex of the SHA-256 of the set's
// files: for each *.cedar file in name order, the netstrings
// "<len>:<base name>," and "<len>:<content>,". Two loads of the same files
// have the same hash wherever the directory lives.
func (s *Set) Hash() string { return s.hash }

// Version returns the label, "@" and the first 12 hex digits of the hash,
// such as "v41@3f2a9c1b0d7e": what decision events carry. A nil set has
// the empty version, as Engine.Active returns while none is active.
func (s *Set) Version() string {
	if s == nil {
		return ""
	}
	return s.version
}

// PolicyIDs returns the ids of the set's policies, sorted.
func (s *Set) PolicyIDs() []string {
	ids := make([]string, len(s.policies))
	for i := range s.policies {
		ids[i] = string(s.policies[i].id)
	}
	slices.Sort(ids)
	return ids
}

// String returns the version.
func (s *Set) String() string { return s.Version() }

// Demo returns the embedded demo policy set (demo/*.cedar), labelled
// DemoLabel.
func Demo() (*Set, error) {
	sub, err := fs.Sub(demoFS, "demo")
	if err != nil {
		return nil, err
	}
	return LoadFS(sub, DemoLabel)
}

// LoadDir loads the *.cedar files directly in dir (not in sub-directories)
// as one set labelled label. A syntax error is a *ParseError naming the
// file and position.
func LoadDir(dir, label string) (*Set, error) {
	return LoadFS(os.DirFS(dir), label)
}

// LoadFS is LoadDir over a file system, for embedded policies.
func LoadFS(fsys fs.FS, label string) (*Set, error) {
	files, err := readFiles(fsys)
	if err != nil {
		return nil, err
	}
	return parse(files, label, hashFiles(files))
}

// file is one policy file.
type file struct {
	name string
	data []byte
}

// readFiles reads the *.cedar files at the root of fsys, sorted by name.
func readFiles(fsys fs.FS) ([]file, error) {
	names, err := fs.Glob(fsys, "*.cedar")
	if err != nil {
		return nil, fmt.Errorf("list policy files: %w", err)
	}
	slices.Sort(names)
	var files []file
	for _, n := range names {
		st, err := fs.Stat(fsys, n)
		if err != nil {
			return nil, fmt.Errorf("policy file %s: %w", n, err)
		}
		if st.IsDir() {
			continue
		}
		b, err := fs.ReadFile(fsys, n)
		if err != nil {
			return nil, fmt.Errorf("policy file %s: %w", n, err)
		}
		files = append(files, file{name: n, data: b})
	}
	if len(files) == 0 {
		return nil, ErrNoPolicies
	}
	return files, nil
}

// hashFiles returns the set hash of files (sorted by name); see Set.Hash.
// Length prefixes make the concatenation unambiguous: moving a policy from
// one file to another changes the hash.
func hashFiles(files []file) string {
	h := sha256.New()
	for _, f := range files {
		for _, part := range [][]byte{[]byte(path.Base(f.name)), f.data} {
			h.Write(strconv.AppendInt(nil, int64(len(part)), 10))
			h.Write([]byte{':'})
			h.Write(part)
			h.Write([]byte{','})
		}
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil))
}

// parse builds a set from files.
func parse(files []file, label, hash string) (*Set, error) {
	if label == "" || strings.ContainsAny(label, "@ \t\r\n") {
		return nil, fmt.Errorf("%w: label %q must be non-empty, without '@' or spaces", ErrInvalidSet, label)
	}
	short := strings.TrimPrefix(hash, "sha256:")[:12]
	s := &Set{label: label, hash: hash, version: label + "@" + short, byID: make(map[cedar.PolicyID]*entry)}
	for _, f := range files {
		list, err := cedar.NewPolicyListFromBytes(f.name, f.data)
		if err != nil {
			return nil, &ParseError{File: f.name, Err: err}
		}
		for i, p := range list {
			ann := p.Annotations()
			// Without @id, the policy keeps cedar-go's own name
			// ("policy<n>", n counting from 0 in its file), prefixed
			// with the file so that names are unique in the set.
			id := cedar.PolicyID(f.name + ":policy" + strconv.Itoa(i))
			if v, ok := ann[annotationID]; ok {
				if v == "" {
					return nil, fmt.Errorf("%w: %s: policy %d has an empty @id", ErrInvalidSet, f.name, i)
				}
				id = cedar.PolicyID(v)
			}
			if _, dup := s.byID[id]; dup {
				return nil, fmt.Errorf("%w: %s: duplicate policy id %q", ErrInvalidSet, f.name, string(id))
			}
			ob, err := parseObligations(ann)
			if err != nil {
				return nil, fmt.Errorf("%w: %s: policy %q: %w", ErrInvalidSet, f.name, string(id), err)
			}
			sc, err := scopeOf(p)
			if err != nil {
				return nil, fmt.Errorf("%w: %s: policy %q: read its scope: %w", ErrInvalidSet, f.name, string(id), err)
			}
			if err := sc.check(); err != nil {
				return nil, fmt.Errorf("%w: %s: policy %q: %w", ErrInvalidSet, f.name, string(id), err)
			}
			for j := range ob.RateLimits {
				ob.RateLimits[j].Policy = string(id)
			}
			s.policies = append(s.policies, entry{id: id, policy: p, permit: p.Effect() == cedar.Permit, obligations: ob, scope: sc})
			s.byID[id] = nil // reserved; pointers are taken once the slice stops growing
		}
	}
	for i := range s.policies {
		s.byID[s.policies[i].id] = &s.policies[i]
	}
	s.collectMasks()
	return s, nil
}

// auditMask returns the fields that any policy of the set, permit or
// forbid, masks (@mask) for tool, sorted and without duplicates: what
// every copy of the call's arguments kept for audit hides, whatever the
// decision. A denial carries no obligations, and a call a forbid stopped
// holds the same sensitive fields as one a permit let through. The
// slice is the caller's.
func (s *Set) auditMask(tool string) []string {
	if m, ok := s.masks[tool]; ok {
		return slices.Clone(m)
	}
	return slices.Clone(s.allMasks)
}

// collectMasks gathers each policy's @mask by the tools its action scope
// names. A scope that names no action (`action`), or one this reading
// does not know, counts for every tool: masking too much in an audit copy
// loses a little audit detail, masking too little leaks. Conditions are
// not read (a `when { context.tool == ... }` counts for every tool), for
// the same reason.
func (s *Set) collectMasks() {
	perTool := make(map[string][]string)
	for i := range s.policies {
		p := &s.policies[i]
		if len(p.obligations.Mask) == 0 {
			continue
		}
		tools, all := p.scope.actionTools()
		if all {
			s.allMasks = append(s.allMasks, p.obligations.Mask...)
			continue
		}
		for _, t := range tools {
			perTool[t] = append(perTool[t], p.obligations.Mask...)
		}
	}
	s.allMasks = sortedSet(s.allMasks)
	s.masks = make(map[string][]string, len(perTool))
	for t, m := range perTool {
		s.masks[t] = sortedSet(append(m, s.allMasks...))
	}
}

// sortedSet sorts l and drops its duplicates; nil when empty.
func sortedSet(l []string) []string {
	if len(l) == 0 {
		return nil
	}
	slices.Sort(l)
	return slices.Clip(slices.Compact(l))
}

// actionTools returns the tools the action scope names, or all when it
// may apply to any tool: {"op": "All"}, or "==" or "in" an action or
// actions. Actions have no parents here (the engine passes Cedar no
// action entities), so `in` an action is that action.
func (sc policyScope) actionTools() (tools []string, all bool) {
	a := sc.Action
	if a.Op != "==" && a.Op != "in" {
		return nil, true
	}
	for _, e := range a.entities() {
		if name, ok := strings.CutPrefix(e.ID, actionToolPrefix); ok && e.Type == string(typeAction) {
			tools = append(tools, name)
		}
	}
	return tools, false
}

// policyScope is a policy's scope in Cedar's JSON policy format, Cedar's
// documented form of a policy, read once as the set loads.
type policyScope struct {
	Principal, Action, Resource scopeClause
}

// scopeClause is one of a scope's three: {"op": "All"}, "==" or "in" an
// entity (or, for an action, "in" entities), or "is" a type, "in" an
// entity or not.
type scopeClause struct {
	Op         string        `json:"op"`
	Entity     *scopeEntity  `json:"entity"`
	Entities   []scopeEntity `json:"entities"`
	EntityType string        `json:"entity_type"`
	In         *struct {
		Entity *scopeEntity `json:"entity"`
	} `json:"in"`
}

type scopeEntity struct {
	Type string `json:"type"`
	ID   string `json:"id"`
}

// entities returns the entities c names.
func (c scopeClause) entities() []scopeEntity {
	ents := slices.Clone(c.Entities)
	if c.Entity != nil {
		ents = append(ents, *c.Entity)
	}
	if c.In != nil && c.In.Entity != nil {
		ents = append(ents, *c.In.Entity)
	}
	return ents
}

func scopeOf(p *cedar.Policy) (policyScope, error) {
	var sc policyScope
	b, err := p.MarshalJSON()
	if err != nil {
		return sc, err
	}
	return sc, json.Unmarshal(b, &sc)
}

// check refuses a scope that names an entity no call is (entities have
// no parents here, so `in` one is being it): a principal not a User, a
// resource not a Resource, an action not a tool's
// (Action::"tool::<name>"). Such a policy never applies: a forbid
// written `action == Action::"refund_order"` would load and deny
// nothing, as an obligation misspelt would weaken a rule.
func (sc policyScope) check() error {
	for _, c := range []struct {
		name  string
		want  cedar.EntityType
		scope scopeClause
	}{{"principal", typeUser, sc.Principal}, {"action", typeAction, sc.Action}, {"resource", typeResource, sc.Resource}} {
		if c.scope.EntityType != "" && c.scope.EntityType != string(c.want) {
			return fmt.Errorf("its %s scope is %s, which no call's %s is: they are %s", c.name, c.scope.EntityType, c.name, c.want)
		}
		for _, e := range c.scope.entities() {
			switch {
			case e.Type != string(c.want):
				return fmt.Errorf("its %s scope names %s::%q, which no call's %s is: they are %s entities", c.name, e.Type, e.ID, c.name, c.want)
			case c.want == typeAction && !strings.HasPrefix(e.ID, actionToolPrefix):
				return fmt.Errorf("its action scope names Action::%q, which no call is: a tool's action is Action::\"%s<tool name>\"", e.ID, actionToolPrefix)
			}
		}
	}
	return nil
}
