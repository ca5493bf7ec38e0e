package schemas

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/santhosh-tekuri/jsonschema/v5"
)

// Draft202012 is the only $schema a registry input schema may declare.
const Draft202012 = "https://json-schema.org/draft/2020-12/schema"

// EnvelopeSchemaID is the $id of the embedded envelope schema.
const EnvelopeSchemaID = SchemaBaseURL + "envelope.schema.json"

// MaxAssertionBytes bounds an envelope's assertion (the schema's
// maxLength; a JWS is ASCII, its characters its bytes): the verifier's
// limit (ledger/token.DefaultMaxBytes), so that an envelope the schema
// accepts does not carry an assertion every verifier refuses.
const MaxAssertionBytes = 8192

// ValidationError reports the most specific place where a document fails its
// schema. It never quotes the offending value (a value may sit in a redacted
// field), only names, limits and patterns from the schema.
type ValidationError struct {
	// Schema is the $id of the schema that failed.
	Schema string
	// Pointer is the RFC 6901 pointer of the offending value, relative to
	// the validated document. For a missing required property it is the
	// pointer the property would have; for a property that
	// additionalProperties forbids it is that property's pointer.
	Pointer string
	// Keyword is the JSON Schema keyword that failed ("required", "type",
	// "additionalProperties", "format", ...), so callers can classify the
	// failure without reading Reason.
	Keyword string
	// Reason is for humans.
	Reason string
}

// Error returns the schema, the pointer and the reason.
func (e *ValidationError) Error() string {
	ptr := e.Pointer
	if ptr == "" {
		ptr = "(root)"
	}
	return fmt.Sprintf("schema %s: %s: %s", e.Schema, ptr, e.Reason)
}

// ValidateEnvelope checks a decoded envelope tree against the embedded
// envelope schema (compiled once per process). A failure is a
// *ValidationError whose Pointer is relative to the envelope.
func ValidateEnvelope(v any) error {
	if envelopeMeets(v) {
		return nil
	}
	return validateEnvelopeSchema(v)
}

// validateEnvelopeSchema is ValidateEnvelope without its fast path.
func validateEnvelopeSchema(v any) error {
	s, err := envelopeSchema()
	if err != nil {
		return err
	}
	return validate(s, EnvelopeSchemaID, v)
}

// envelopeSchema compiles the embedded envelope schema on first use. The
// compiled schema is immutable, so sharing it is not shared mutable state.
var envelopeSchema = sync.OnceValues(func() (*jsonschema.Schema, error) {
	doc, err := files.ReadFile("envelope.schema.json")
	if err != nil {
		return nil, fmt.Errorf("schemas: read embedded envelope schema: %w", err)
	}
	s, err := compile(EnvelopeSchemaID, doc)
	if err != nil {
		return nil, fmt.Errorf("schemas: compile embedded envelope schema: %w", err)
	}
	return s, nil
})

// errNoRemoteRefs refuses every $ref the compiler would load from outside
// the document: a registry is self-contained and never reaches the network
// or the file system through a schema.
var errNoRemoteRefs = errors.New("schemas: external $ref not allowed")

// compile compiles one self-contained draft 2020-12 schema with format
// assertions on (draft 2020-12 treats format as an annotation otherwise).
func compile(id string, doc []byte) (*jsonschema.Schema, error) {
	c := jsonschema.NewCompiler()
	c.Draft = jsonschema.Draft2020
	c.AssertFormat = true
	c.LoadURL = func(s string) (io.ReadCloser, error) {
		return nil, fmt.Errorf("%w: %s", errNoRemoteRefs, s)
	}
	if err := c.AddResource(id, bytes.NewReader(doc)); err != nil {
		return nil, err
	}
	return c.Compile(id)
}

// validate runs a compiled schema and turns its error into a
// *ValidationError.
func validate(s *jsonschema.Schema, id string, v any) error {
	if s == nil {
		return &ValidationError{Schema: id, Reason: "schema not compiled (tool not loaded through a Registry)"}
	}
	err := validateRecovering(s, v)
	if err == nil {
		return nil
	}
	var ve *jsonschema.ValidationError
	if !errors.As(err, &ve) {
		// An infinite $ref loop or a Go value that is not JSON: still a
		// failure of this document, reported as one.
		return &ValidationError{Schema: id, Reason: err.Error()}
	}
	return fromJSONSchema(id, ve, v)
}

// validateRecovering runs the validator and turns a panic inside it into a
// failure of this document. The library panics on some pathological numbers
// (it parses them with big.Rat, which refuses exponents beyond 1e6 and
// returns nil); ledger.Decode never produces those, but the intake must not
// crash on any input even if a tree arrives by another path.
func validateRecovering(s *jsonschema.Schema, v any) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("validator failed on this document: %v", r)
		}
	}()
	return s.Validate(v)
}

// fromJSONSchema picks the most specific leaf of a jsonschema error tree:
// the deepest instance location, ties broken by pointer then keyword so that
// the choice does not depend on map iteration order.
func fromJSONSchema(id string, root *jsonschema.ValidationError, doc any) *ValidationError {
	var best *ValidationError
	bestDepth := -1
	var walk func(e *jsonschema.ValidationError)
	walk = func(e *jsonschema.ValidationError) {
		if len(e.Causes) > 0 {
			for _, c := range e.Causes {
				walk(c)
			}
			return
		}
		cand := leaf(id, e, doc)
		d := strings.Count(cand.Pointer, "/")
		switch {
		case best == nil, d > bestDepth,
			d == bestDepth && (cand.Pointer < best.Pointer ||
				cand.Pointer == best.Pointer && cand.Keyword < best.Keyword):
			best, bestDepth = cand, d
		}
	}
	walk(root)
	if best == nil {
		return &ValidationError{Schema: id, Reason: root.Message}
	}
	return best
}

// leaf converts one jsonschema leaf error of doc.
func leaf(id string, e *jsonschema.ValidationError, doc any) *ValidationError {
	ptr := instancePointer(e.InstanceLocation)
	kw := keyword(e.KeywordLocation)
	reason := e.Message
	switch kw {
	case "required":
		// "missing properties: 'a', 'b'": point at the first missing one.
		if names := quotedNames(strings.TrimPrefix(e.Message, "missing properties: ")); len(names) > 0 {
			ptr += "/" + escapeToken(names[0])
			reason = "missing required property"
		}
	case "additionalProperties":
		// With additionalProperties:false the library reports the object;
		// point at the (first) property that is not allowed instead.
		if rest, ok := strings.CutPrefix(e.Message, "additionalProperties "); ok {
			if name, ok := notAllowed(doc, ptr, strings.TrimSuffix(rest, " not allowed")); ok {
				ptr += "/" + escapeToken(name)
				reason = "property not allowed"
			}
		}
	case "format":
		// "<value> is not valid '<format>'": drop the value.
		if i := strings.LastIndex(e.Message, " is not valid "); i >= 0 {
			reason = "is not a valid " + e.Message[i+len(" is not valid "):]
		}
	case "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum":
		// "must be >= 1 but found <value>": drop the value.
		reason, _, _ = strings.Cut(e.Message, " but found ")
	case "multipleOf":
		if i := strings.LastIndex(e.Message, " not multipleOf "); i >= 0 {
			reason = "must be a multiple of " + e.Message[i+len(" not multipleOf "):]
		}
	case "not":
		// The library says "not failed".
		reason = "is a value the schema rules out (its \"not\")"
	}
	return &ValidationError{Schema: id, Pointer: ptr, Keyword: kw, Reason: reason}
}

// keyword returns the failing keyword of a keyword location such as
// "/properties/amount_cents/minimum". Locations ending in an index
// ("/dependentRequired/a/0") name the keyword two segments up.
func keyword(loc string) string {
	segs := strings.Split(loc, "/")
	last := segs[len(segs)-1]
	if _, err := strconv.Atoi(last); err == nil && len(segs) >= 3 {
		return segs[len(segs)-3]
	}
	return last
}

// instancePointer converts the library's instance location, whose tokens
// are RFC 6901 escaped and then URL path escaped, into a plain RFC 6901
// pointer.
func instancePointer(loc string) string {
	if loc == "" {
		return ""
	}
	toks := strings.Split(loc, "/")
	for i, t := range toks {
		if u, err := url.PathUnescape(t); err == nil {
			toks[i] = u
		}
	}
	return strings.Join(toks, "/")
}

// notAllowed finds, among the properties of the object at ptr in doc, the
// first by name that the library's list of properties not allowed names.
// The names are matched against the document rather than parsed out of
// the list: the library's quoting is ambiguous (a name ending in a
// backslash comes out as if its closing quote were escaped), and it lists
// them in map order.
func notAllowed(doc any, ptr, list string) (string, bool) {
	v, _ := ResolvePointer(doc, ptr)
	obj, ok := v.(map[string]any)
	if !ok {
		return "", false
	}
	names := make([]string, 0, len(obj))
	for k := range obj {
		names = append(names, k)
	}
	slices.Sort(names)
	for _, k := range names {
		q := libraryQuote(k)
		if list == q || strings.HasPrefix(list, q+", ") || strings.HasSuffix(list, ", "+q) || strings.Contains(list, ", "+q+", ") {
			return k, true
		}
	}
	return "", false
}

// libraryQuote quotes a property name the way the validator library does
// in its messages: Go quoting, double quotes unescaped, single quotes
// escaped, in single quotes.
func libraryQuote(s string) string {
	q := strconv.Quote(s)
	q = strings.ReplaceAll(q, `\"`, `"`)
	q = strings.ReplaceAll(q, `'`, `\'`)
	return "'" + q[1:len(q)-1] + "'"
}

// escapeToken escapes one reference token per RFC 6901.
func escapeToken(s string) string {
	if !strings.ContainsAny(s, "~/") {
		return s
	}
	return strings.ReplaceAll(strings.ReplaceAll(s, "~", "~0"), "/", "~1")
}

// quotedNames parses the library's list of single-quoted names ("'a', 'b'";
// inside the quotes, Go %q escaping with \' for a quote and a bare ") and
// returns them unquoted and sorted.
func quotedNames(s string) []string {
	var names []string
	for i := 0; i < len(s); i++ {
		if s[i] != '\'' {
			continue
		}
		var raw strings.Builder
		j := i + 1
		for ; j < len(s) && s[j] != '\''; j++ {
			switch {
			case s[j] == '\\' && j+1 < len(s) && s[j+1] == '\'':
				raw.WriteByte('\'')
				j++
			case s[j] == '\\' && j+1 < len(s):
				raw.WriteByte(s[j])
				raw.WriteByte(s[j+1])
				j++
			case s[j] == '"':
				raw.WriteString(`\"`)
			default:
				raw.WriteByte(s[j])
			}
		}
		if j >= len(s) {
			break
		}
		if name, err := strconv.Unquote(`"` + raw.String() + `"`); err == nil {
			names = append(names, name)
		}
		i = j
	}
	sort.Strings(names)
	return names
}
