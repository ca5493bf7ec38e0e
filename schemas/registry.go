// Package schemas holds the envelope schema and the tool registry (DESIGN
// §3 and §6): one JSON file per tool version, each with a JSON Schema of the
// tool's arguments compiled once at load.
//
// Files:
//   - envelope.schema.json, tools/*.json: the embedded schema and demo registry
//   - tool.go: Tool and its typed fields
//   - registry.go: Registry, Load, Demo
//   - validate.go: ValidationError, ValidateEnvelope, schema compilation
//
// The package imports only the standard library and jsonschema/v5; the
// ledger package (strict decoding, hashing) imports it, not the reverse.
package schemas

import (
	"bytes"
	"cmp"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"path"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/santhosh-tekuri/jsonschema/v5"
)

// files holds the envelope schema and the demo registry.
//
//go:embed envelope.schema.json tools/*.json
var files embed.FS

// EnvelopeSchema returns the embedded envelope schema document, for
// publishing to agent authors.
func EnvelopeSchema() []byte {
	b, _ := files.ReadFile("envelope.schema.json")
	return b
}

// Lookup errors. Both are wrapped with the name (and version) asked for.
var (
	// ErrUnknownTool: no version of the tool is registered.
	ErrUnknownTool = errors.New("unknown tool")
	// ErrUnknownVersion: the tool exists, but not at that version.
	ErrUnknownVersion = errors.New("unknown tool version")
	// ErrOtherDefinition: the registry defines the tool version, but not
	// as the definition a call was admitted under (Registry.Bound).
	ErrOtherDefinition = errors.New("tool version defined otherwise")
)

// Registry is a loaded, immutable set of tool versions. It is safe for
// concurrent use.
type Registry struct {
	byName map[string]map[int]*Tool
	sorted []*Tool
}

// Demo loads the demo registry embedded in the binary (get_weather,
// create_ticket, refund_order, send_email). Each call compiles a fresh
// Registry.
func Demo() (*Registry, error) {
	r, err := Load(files)
	if err != nil {
		return nil, fmt.Errorf("demo registry: %w", err)
	}
	return r, nil
}

// DemoFiles returns the files of the demo registry embedded in the binary
// (tools/<name>.v<version>.json), for a tool that writes a variant of it
// (the reliability suite shortens the tools' timeouts).
func DemoFiles() fs.FS { return files }

// fileNameRE is what a registry file must be called: <name>.v<version>.json.
var fileNameRE = regexp.MustCompile(`^([a-z][a-z0-9_]{0,63})\.v([1-9][0-9]{0,8})\.json$`)

// Load reads every tools/*.json file of fsys (os.DirFS(dir) for a registry
// on disk), checks it and compiles its input schema. A file with an unknown
// field, a bad enum, a name or version that disagrees with its file name, an
// input schema without a top-level "additionalProperties": false, or a
// compensation naming a tool version the registry lacks fails the whole load
// with an error naming the file. A registry without any tool is an error too.
func Load(fsys fs.FS) (*Registry, error) {
	names, err := fs.Glob(fsys, "tools/*.json")
	if err != nil {
		return nil, fmt.Errorf("schemas: list tools: %w", err)
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("schemas: no tool files (tools/*.json)")
	}
	sort.Strings(names)
	r := &Registry{byName: make(map[string]map[int]*Tool)}
	for _, name := range names {
		t, err := loadFile(fsys, name)
		if err != nil {
			return nil, fmt.Errorf("schemas: %s: %w", name, err)
		}
		if r.byName[t.Name] == nil {
			r.byName[t.Name] = make(map[int]*Tool)
		}
		// fileNameRE allows no leading zeros, so two files can't claim
		// the same version.
		r.byName[t.Name][t.Version] = t
		r.sorted = append(r.sorted, t)
	}
	for _, t := range r.sorted {
		if c := t.Compensation; c != nil {
			if _, err := r.Lookup(c.Tool, c.Version); err != nil {
				return nil, fmt.Errorf("schemas: tools/%s.v%d.json: compensation: %w", t.Name, t.Version, err)
			}
		}
	}
	sort.Slice(r.sorted, func(i, j int) bool {
		a, b := r.sorted[i], r.sorted[j]
		if a.Name != b.Name {
			return a.Name < b.Name
		}
		return a.Version < b.Version
	})
	return r, nil
}

// loadFile reads, checks and compiles one registry file.
func loadFile(fsys fs.FS, name string) (*Tool, error) {
	m := fileNameRE.FindStringSubmatch(path.Base(name))
	if m == nil {
		return nil, fmt.Errorf("%w: file name must be <name>.v<version>.json", ErrInvalidTool)
	}
	fileTool := m[1]
	fileVersion, _ := strconv.Atoi(m[2]) // at most 9 digits: no overflow

	data, err := fs.ReadFile(fsys, name)
	if err != nil {
		return nil, err
	}
	if err := unambiguous(data); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidTool, err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var t Tool
	if err := dec.Decode(&t); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidTool, err)
	}
	if dec.More() {
		return nil, fmt.Errorf("%w: trailing data after the tool object", ErrInvalidTool)
	}
	if err := t.check(); err != nil {
		return nil, err
	}
	if t.Name != fileTool || t.Version != fileVersion {
		return nil, fmt.Errorf("%w: file declares %s.v%d, its name says %s.v%d",
			ErrInvalidTool, t.Name, t.Version, fileTool, fileVersion)
	}
	doc, err := inputSchemaDoc(t.InputSchema, t.SchemaID())
	if err != nil {
		return nil, fmt.Errorf("%w: input_schema: %w", ErrInvalidTool, err)
	}
	s, err := compile(t.SchemaID(), doc)
	if err != nil {
		return nil, fmt.Errorf("%w: input_schema: %w", ErrInvalidTool, err)
	}
	t.schema = s
	if t.digest, err = definitionDigest(&t); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidTool, err)
	}
	return &t, nil
}

// inputSchemaDoc checks the parts of an input schema the ledger relies on
// and returns it with its absolute $id set.
func inputSchemaDoc(raw json.RawMessage, id string) ([]byte, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var m map[string]any
	if err := dec.Decode(&m); err != nil || m == nil {
		return nil, fmt.Errorf("must be a JSON object")
	}
	if s, ok := m["$schema"]; ok && s != Draft202012 {
		return nil, fmt.Errorf("$schema must be %q (or absent)", Draft202012)
	}
	if got, ok := m["$id"]; ok && got != id {
		return nil, fmt.Errorf("$id %v must be %q (or absent)", got, id)
	}
	if m["type"] != "object" {
		return nil, fmt.Errorf(`top level must say "type": "object"`)
	}
	if m["additionalProperties"] != false {
		// Without it an argument the schema does not name would pass
		// validation unchecked and reach the backend.
		return nil, fmt.Errorf(`top level must say "additionalProperties": false`)
	}
	ptr, err := openRef(m, m, "", true)
	if err != nil {
		return nil, err
	}
	if ptr == "" {
		ptr = openObject(m, "", instance{})
	}
	if ptr != "" {
		return nil, fmt.Errorf(`the schema at %s lets objects through open: an object schema must say "additionalProperties": false (or give the schema of the members it allows), and a property's or an item's schema what it is (a type, enum, const or $ref; {}, true or annotations alone admit any object, as does an array without items): an object inside the arguments is as strict as the top level`, ptr)
	}
	if ptr, why := unasserted(m, ""); ptr != "" {
		return nil, fmt.Errorf("the schema at %s %s", ptr, why)
	}
	m["$id"] = id
	return json.Marshal(m)
}

// Subschema keywords of JSON Schema 2020-12 that openObject walks. Those
// of memberKeywords describe members of the instance (a property, an
// item), which must be closed in their own right and say what they are
// (openMember); those of sameInstance*Keywords describe the instance
// itself, whose closure (its additionalProperties or
// unevaluatedProperties) holds for them. evaluatingKeywords describe the
// instance too, but only test it: they admit members only where the
// instance is closed by unevaluatedProperties alone (JSON Schema admits
// what a passing if, or a dependentSchemas entry, evaluated), and are
// walked there. not admits nothing (what it evaluates is not counted):
// it is not walked.
var (
	memberKeywords           = []string{"additionalProperties", "unevaluatedProperties", "items", "contains", "unevaluatedItems", "propertyNames"}
	memberListKeywords       = []string{"prefixItems"}
	memberTableKeywords      = []string{"properties", "patternProperties", "$defs", "definitions"}
	sameInstanceKeywords     = []string{"then", "else"}
	sameInstanceListKeywords = []string{"allOf", "anyOf", "oneOf"}
	evaluatingKeywords       = []string{"if"}
	// dependencies is draft 7's, which the validator still applies
	// under 2020-12: its schema form is dependentSchemas' (its array
	// form, required members, is no schema and is passed over).
	evaluatingTableKeywords = []string{"dependentSchemas", "dependencies"}
)

// annotationKeywords change nothing a schema accepts: a schema of only
// these accepts anything, as true does.
var annotationKeywords = []string{"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly"}

// assertedKeywords are the keywords of JSON Schema 2020-12 a registry
// schema may use, besides annotationKeywords: those the validator applies
// (the core, applicator, unevaluated, validation and format vocabularies;
// the definitions and dependencies of draft 7, which it still applies),
// and "x-" extensions, which say they check nothing. Any other passes the
// meta-schema and is ignored: a misspelt "maxlenght" would check
// nothing. The content vocabulary is not asserted (contentEncoding,
// contentMediaType, contentSchema), so it is refused too.
var assertedKeywords = map[string]bool{
	"$schema": true, "$id": true, "$ref": true, "$anchor": true, "$dynamicRef": true, "$dynamicAnchor": true, "$vocabulary": true, "$defs": true, "definitions": true,
	"prefixItems": true, "items": true, "contains": true, "additionalProperties": true, "properties": true, "patternProperties": true,
	"dependentSchemas": true, "dependencies": true, "propertyNames": true, "if": true, "then": true, "else": true,
	"allOf": true, "anyOf": true, "oneOf": true, "not": true, "unevaluatedItems": true, "unevaluatedProperties": true,
	"type": true, "const": true, "enum": true, "multipleOf": true, "maximum": true, "exclusiveMaximum": true, "minimum": true,
	"exclusiveMinimum": true, "maxLength": true, "minLength": true, "pattern": true, "maxItems": true, "minItems": true,
	"uniqueItems": true, "maxContains": true, "minContains": true, "maxProperties": true, "minProperties": true,
	"required": true, "dependentRequired": true, "format": true,
}

// unasserted returns the JSON pointer of the first keyword in schema (at
// ptr) that would check nothing, and why, or "" if there is none: one
// that is not a keyword (assertedKeywords), or a format the validator
// does not know (it asserts the formats of jsonschema.Formats and passes
// any other: "int32" or "idn-email" would let anything through).
func unasserted(schema any, ptr string) (string, string) {
	m, ok := schema.(map[string]any)
	if !ok {
		return "", ""
	}
	_, hasIf := m["if"]
	_, hasContains := m["contains"]
	for _, k := range slices.Sorted(maps.Keys(m)) {
		kp := ptr + "/" + escapeToken(k)
		switch {
		case k == "format":
			if f, _ := m[k].(string); jsonschema.Formats[f] == nil {
				return kp, fmt.Sprintf("names a format the validator does not check (%q): it would let any value through; use pattern, or one of %s", f, strings.Join(slices.Sorted(maps.Keys(jsonschema.Formats)), ", "))
			}
			if t, typed := m["type"]; typed && !typeAdmits(t, "string") {
				return kp, "is a format of a schema that admits no string: formats check strings alone, and it would check nothing"
			}
		case (k == "then" || k == "else") && !hasIf:
			return kp, `applies only beside "if", which this schema lacks: it would check nothing`
		case (k == "minContains" || k == "maxContains") && !hasContains:
			return kp, `applies only beside "contains", which this schema lacks: it would check nothing`
		case strings.HasPrefix(k, "x-") || slices.Contains(annotationKeywords, k):
		case !assertedKeywords[k]:
			return kp, "is no keyword of JSON Schema 2020-12 the validator applies (content keywords included): it would check nothing; schemas a $ref names go under $defs, and an extension that checks nothing is named x-..."
		}
	}
	for _, k := range slices.Concat(memberKeywords, sameInstanceKeywords, evaluatingKeywords, []string{"not"}) {
		if p, why := unasserted(m[k], ptr+"/"+k); p != "" {
			return p, why
		}
	}
	for _, k := range slices.Concat(memberListKeywords, sameInstanceListKeywords) {
		list, _ := m[k].([]any)
		for i, sub := range list {
			if p, why := unasserted(sub, fmt.Sprintf("%s/%s/%d", ptr, k, i)); p != "" {
				return p, why
			}
		}
	}
	for _, k := range slices.Concat(memberTableKeywords, evaluatingTableKeywords) {
		table, _ := m[k].(map[string]any)
		for _, name := range slices.Sorted(maps.Keys(table)) {
			if p, why := unasserted(table[name], ptr+"/"+k+"/"+escapeToken(name)); p != "" {
				return p, why
			}
		}
	}
	return "", ""
}

// unambiguous refuses a registry file that names a member twice in one
// object, or in two spellings that differ only in case: encoding/json
// takes the last and matches field names without regard to case, so a
// reviewer reading the first "risk" would not see the "Risk" that loads.
// Envelopes are refused so too (ledger.Decode).
func unambiguous(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	// One level per open object or array: an object's names so far (by
	// their folded spelling) and the member being read; an array's
	// next index.
	type level struct {
		names  map[string]string
		member string
		value  bool // the member's name read, its value next
		index  int
	}
	var stack []*level
	pointer := func() string {
		var b strings.Builder
		for _, l := range stack[:len(stack)-1] {
			if l.names != nil {
				b.WriteString("/" + escapeToken(l.member))
			} else {
				fmt.Fprintf(&b, "/%d", l.index-1)
			}
		}
		return cmp.Or(b.String(), "/")
	}
	// valued notes that the current level read a value.
	valued := func() {
		if len(stack) == 0 {
			return
		}
		if l := stack[len(stack)-1]; l.names != nil {
			l.value = false
		} else {
			l.index++
		}
	}
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if len(stack) > 0 {
			if l := stack[len(stack)-1]; l.names != nil && !l.value {
				if name, ok := tok.(string); ok {
					folded := FoldName(name)
					if first, dup := l.names[folded]; dup {
						if first == name {
							return fmt.Errorf("the object at %s names %q twice: the last would be taken", pointer(), name)
						}
						return fmt.Errorf("the object at %s names %q and %q, which differ only in case: the last would be taken", pointer(), first, name)
					}
					l.names[folded], l.member, l.value = name, name, true
					continue
				}
			}
		}
		switch tok {
		case json.Delim('{'):
			valued()
			stack = append(stack, &level{names: map[string]string{}})
		case json.Delim('['):
			valued()
			stack = append(stack, &level{})
		case json.Delim('}'), json.Delim(']'):
			stack = stack[:len(stack)-1]
		default:
			valued()
		}
	}
}

// FoldName returns a representative of s's case-folding class, as
// encoding/json matches field names: two strings are equal under
// strings.EqualFold exactly when their FoldNames are ("riſk", with a long
// s, is "risk"'s). Each rune maps to the smallest rune of its
// unicode.SimpleFold orbit.
func FoldName(s string) string {
	ascii := true
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			ascii = false
			break
		}
	}
	if ascii {
		// For ASCII letters the orbit minimum is the upper-case letter
		// (the orbits of k and s hold non-ASCII runes, all larger).
		return strings.ToUpper(s)
	}
	var b strings.Builder
	b.Grow(len(s))
	for _, r := range s {
		least := r
		for f := unicode.SimpleFold(r); f != r; f = unicode.SimpleFold(f) {
			least = min(least, f)
		}
		b.WriteRune(least)
	}
	return b.String()
}

// instance is what openObject knows of the instance a schema describes
// from the schemas of it it was reached through (a branch's parent).
type instance struct {
	// closed: its members are closed (openObject's doc).
	closed bool
	// static: closed by additionalProperties, which admits only the
	// members its own schema's properties and patternProperties name,
	// whatever a subschema evaluates.
	static bool
	// items: an items schema checks every item, whatever contains
	// says.
	items bool
}

// openObject returns the JSON pointer of the first object schema in
// schema (at ptr) that leaves its other members open, or "" if there is
// none. An object schema is closed by "additionalProperties": false or a
// schema that constrains ({} and annotations alone do not), by
// "unevaluatedProperties": false, by a $ref (the schema it names is
// walked where it is defined), or, for a branch of allOf, anyOf, oneOf,
// if, then, else or dependentSchemas, by the closure of the schema it is
// a branch of (in).
func openObject(schema any, ptr string, in instance) string {
	m, ok := schema.(map[string]any)
	if !ok {
		return ""
	}
	_, hasProps := m["properties"]
	_, hasRef := m["$ref"]
	in.static = in.static || m["additionalProperties"] == false || constrains(m["additionalProperties"])
	in.items = in.items || m["items"] != nil
	if isObjectType(m["type"]) || hasProps {
		in.closed = in.closed || hasRef || in.static || m["unevaluatedProperties"] == false
		if !in.closed {
			return cmp.Or(ptr, "/")
		}
	}
	if isArrayType(m["type"]) && !in.items && m["unevaluatedItems"] != false {
		// Items no schema describes are anything, objects included.
		return ptr + "/items"
	}
	for _, k := range memberKeywords {
		as := k
		if k == "contains" && !in.items {
			// No items schema checks every item: under
			// unevaluatedItems false, those contains matches are
			// admitted with what it says of them, as items' are.
			as = "items"
		}
		if p := openMember(m[k], ptr+"/"+k, as); p != "" {
			return p
		}
	}
	same := sameInstanceKeywords
	sameTables := []string(nil)
	if !in.static {
		same = append(slices.Clone(same), evaluatingKeywords...)
		sameTables = evaluatingTableKeywords
	}
	for _, k := range same {
		if p := openObject(m[k], ptr+"/"+k, in); p != "" {
			return p
		}
	}
	for _, k := range sameTables {
		table, _ := m[k].(map[string]any)
		for _, name := range slices.Sorted(maps.Keys(table)) {
			if p := openObject(table[name], ptr+"/"+k+"/"+escapeToken(name), in); p != "" {
				return p
			}
		}
	}
	for _, list := range []struct {
		keys   []string
		member bool
	}{{memberListKeywords, true}, {sameInstanceListKeywords, false}} {
		for _, k := range list.keys {
			subs, _ := m[k].([]any)
			for i, sub := range subs {
				sp := fmt.Sprintf("%s/%s/%d", ptr, k, i)
				var p string
				if list.member {
					p = openMember(sub, sp, k)
				} else {
					p = openObject(sub, sp, in)
				}
				if p != "" {
					return p
				}
			}
		}
	}
	for _, k := range memberTableKeywords {
		table, _ := m[k].(map[string]any)
		for _, name := range slices.Sorted(maps.Keys(table)) {
			if p := openMember(table[name], ptr+"/"+k+"/"+escapeToken(name), k); p != "" {
				return p
			}
		}
	}
	return ""
}

// dataKeywords hold data, not schemas: a "$ref" member in their values is
// no reference. They are keywords only in a schema: in a table of
// schemas (properties, $defs) the same words name members.
var dataKeywords = []string{"const", "enum", "default", "examples"}

// The keywords whose values openRef knows to be schemas, lists of them or
// tables of them by name. Under any other key it knows nothing, and
// passes over nothing: a $ref there is checked too.
var (
	schemaValuedKeywords = slices.Concat(memberKeywords, sameInstanceKeywords, evaluatingKeywords, []string{"not"})
	schemaListKeywords   = slices.Concat(memberListKeywords, sameInstanceListKeywords)
	schemaTableKeywords  = slices.Concat(memberTableKeywords, evaluatingTableKeywords)
)

// openRef returns the JSON pointer of the first schema a $ref in v (at
// ptr) names that openMember finds open, or "" if there is none. root is
// the whole schema. openObject takes a $ref for closed, for the schema it
// names is walked where it is defined: under $defs, or properties, say.
// But a reference may name any place of the document, one openObject does
// not walk (a "components" member of a schema lifted from an OpenAPI
// document), so every schema a $ref names is checked here, in its own
// right, as a member's. A $ref that is no JSON pointer into the document
// (an anchor, an external or meta-schema URL) and a $dynamicRef, whose
// targets this cannot find, are refused. schema says that v is known to
// be a schema, whose data keywords are passed over.
func openRef(root, v any, ptr string, schema bool) (string, error) {
	switch v := v.(type) {
	case []any:
		for i, e := range v {
			if p, err := openRef(root, e, fmt.Sprintf("%s/%d", ptr, i), false); p != "" || err != nil {
				return p, err
			}
		}
	case map[string]any:
		for _, k := range []string{"$dynamicRef", "$recursiveRef"} {
			if _, ok := v[k]; ok {
				return "", fmt.Errorf("the %s at %s is not allowed: name a schema with a $ref into the tool's schema (\"#/$defs/<name>\")", k, cmp.Or(ptr, "/"))
			}
		}
		if _, ok := v["$id"]; ok && ptr != "" {
			// A resource of its own: the $refs under it would name
			// places in it, not in the document this checks them in.
			return "", fmt.Errorf("the $id at %s is not allowed: a tool's schema is one document, its $id the ledger's", ptr)
		}
		if ref, ok := v["$ref"].(string); ok {
			target, tptr, err := refTarget(root, ref)
			if err != nil {
				return "", fmt.Errorf("the $ref at %s: %w", cmp.Or(ptr, "/"), err)
			}
			if p := openMember(target, tptr, "$ref"); p != "" {
				return p, nil
			}
		}
		for _, k := range slices.Sorted(maps.Keys(v)) {
			kp := ptr + "/" + escapeToken(k)
			var (
				p   string
				err error
			)
			table, isTable := v[k].(map[string]any)
			list, isList := v[k].([]any)
			switch {
			case schema && slices.Contains(dataKeywords, k):
				continue
			case schema && isTable && slices.Contains(schemaTableKeywords, k):
				for _, name := range slices.Sorted(maps.Keys(table)) {
					if p, err = openRef(root, table[name], kp+"/"+escapeToken(name), true); p != "" || err != nil {
						break
					}
				}
			case schema && isList && slices.Contains(schemaListKeywords, k):
				for i, e := range list {
					if p, err = openRef(root, e, fmt.Sprintf("%s/%d", kp, i), true); p != "" || err != nil {
						break
					}
				}
			default:
				p, err = openRef(root, v[k], kp, schema && slices.Contains(schemaValuedKeywords, k))
			}
			if p != "" || err != nil {
				return p, err
			}
		}
	}
	return "", nil
}

// refTarget returns the schema in root that ref, a $ref of it, names, and
// its JSON pointer.
func refTarget(root any, ref string) (any, string, error) {
	frag, ok := strings.CutPrefix(ref, "#")
	if !ok || frag != "" && !strings.HasPrefix(frag, "/") {
		return nil, "", fmt.Errorf("%q is not a JSON pointer into the tool's schema (\"#/$defs/<name>\"): external $refs and anchors are not allowed", ref)
	}
	if strings.Contains(frag, "%") {
		// The validator splits the pointer before it undoes the
		// escapes, and a check that undid them first would look at
		// another schema than the one validating ("a%2Fb").
		return nil, "", fmt.Errorf("%q: percent-escapes in a $ref are not allowed: name the schema plainly (\"#/$defs/<name>\")", ref)
	}
	v, ok := ResolvePointer(root, frag)
	if !ok {
		return nil, "", fmt.Errorf("%q names nothing in the tool's schema", ref)
	}
	return v, frag, nil
}

// openMember is openObject for the schema of members of an instance (a
// property, an item) under keyword k: a member schema that admits any
// object ({}, true, annotations alone, a not) leaves that object open, as
// an object schema without additionalProperties would. The names of
// properties (propertyNames) are strings, and contains beside an items
// schema bounds no item: neither is held to it.
func openMember(schema any, ptr, k string) string {
	if k != "propertyNames" && k != "contains" && schema != nil && admitsAnyObject(schema) {
		return ptr
	}
	return openObject(schema, ptr, instance{})
}

// admitsAnyObject reports whether schema lets any object through
// unchecked: true, or an object schema that says nothing of its
// instance's type, value or members (one that does is checked by
// openObject, where it is defined for a $ref).
func admitsAnyObject(schema any) bool {
	switch s := schema.(type) {
	case bool:
		return s
	case map[string]any:
		for _, k := range []string{"type", "$ref", "const", "enum", "properties"} {
			if _, ok := s[k]; ok {
				return false
			}
		}
		if s["additionalProperties"] == false || s["unevaluatedProperties"] == false || constrains(s["additionalProperties"]) {
			return false
		}
		if all, _ := s["allOf"].([]any); slices.ContainsFunc(all, func(b any) bool { return !admitsAnyObject(b) }) {
			return false
		}
		for _, k := range []string{"anyOf", "oneOf"} {
			if some, _ := s[k].([]any); len(some) > 0 && !slices.ContainsFunc(some, admitsAnyObject) {
				return false
			}
		}
		return true
	}
	return false
}

// isObjectType reports whether a schema's type admits objects.
func isObjectType(t any) bool { return typeAdmits(t, "object") }

// isArrayType reports whether a schema's type admits arrays.
func isArrayType(t any) bool { return typeAdmits(t, "array") }

// typeAdmits reports whether a schema's type value names kind.
func typeAdmits(t any, kind string) bool {
	switch t := t.(type) {
	case string:
		return t == kind
	case []any:
		return slices.Contains(t, any(kind))
	}
	return false
}

// constrains reports whether additionalProperties' value v is a schema
// that constrains the members it admits: not true, not {}, not
// annotations alone.
func constrains(v any) bool {
	m, ok := v.(map[string]any)
	if !ok {
		return false
	}
	for k := range m {
		if !slices.Contains(annotationKeywords, k) {
			return true
		}
	}
	return false
}

// Lookup returns the tool at that version. The error wraps ErrUnknownTool
// when no version of name exists, ErrUnknownVersion when that one doesn't.
// The same *Tool is returned on every call.
func (r *Registry) Lookup(name string, version int) (*Tool, error) {
	versions, ok := r.byName[name]
	if !ok {
		return nil, fmt.Errorf("%w: %q", ErrUnknownTool, name)
	}
	t, ok := versions[version]
	if !ok {
		return nil, fmt.Errorf("%w: %s.v%d", ErrUnknownVersion, name, version)
	}
	return t, nil
}

// Bound returns the tool at that version if its definition is the one
// whose Digest is digest: the definition a call was admitted under. The
// error wraps ErrOtherDefinition when the registry defines that version
// otherwise (an edited file, or another registry), and is Lookup's
// when it lacks the version. An empty digest, a call admitted before
// calls recorded one, binds nothing.
func (r *Registry) Bound(name string, version int, digest string) (*Tool, error) {
	t, err := r.Lookup(name, version)
	if err != nil || digest == "" || t.digest == digest {
		return t, err
	}
	return nil, fmt.Errorf("%w: %s.v%d is %s here, the call was admitted under %s", ErrOtherDefinition, name, version, t.digest, digest)
}

// Has reports whether the registry holds a version of the tool name.
func (r *Registry) Has(name string) bool {
	_, ok := r.byName[name]
	return ok
}

// Tools returns every tool version, sorted by name then version. The slice
// is a copy; the tools are shared and must not be modified.
func (r *Registry) Tools() []*Tool {
	out := make([]*Tool, len(r.sorted))
	copy(out, r.sorted)
	return out
}
