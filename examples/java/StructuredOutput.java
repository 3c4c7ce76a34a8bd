// Structured output from llamadeploy using only the JDK (java.net.http, Java 17+): a JSON-schema
// request (response_format json_schema, as Spring AI's BeanOutputConverter or openai-java send it)
// whose answer is parsed into a record. The server constrains decoding to the schema, so the
// content always parses when finish_reason is "stop".
// Run:  java StructuredOutput.java "Acme Corp of Berlin hired 40 engineers in May."
// Env:  LLAMADEPLOY_URL (default http://127.0.0.1:8000/v1), LLAMADEPLOY_MODEL, LLAMADEPLOY_API_KEY (optional).
// Prints the parsed fields, one "name: value" line each; exits 1 on an HTTP error or a cut answer.
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

public class StructuredOutput {
    record Company(String name, String city, List<String> keywords) {}

    static final String SCHEMA = """
        {"type": "object", "additionalProperties": false,
         "required": ["name", "city", "keywords"],
         "properties": {
           "name": {"type": "string", "maxLength": 40},
           "city": {"type": "string", "maxLength": 30},
           "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}}}""";

    public static void main(String[] args) throws Exception {
        String base = System.getenv().getOrDefault("LLAMADEPLOY_URL", "http://127.0.0.1:8000/v1");
        String model = System.getenv().getOrDefault("LLAMADEPLOY_MODEL", "smollm2-135m-instruct");
        String key = System.getenv("LLAMADEPLOY_API_KEY");
        String text = args.length > 0 ? String.join(" ", args) : "Acme Corp of Berlin hired 40 engineers in May.";

        String body = "{\"model\":" + quote(model) + ",\"temperature\":0,\"max_tokens\":200,"
                + "\"messages\":[{\"role\":\"system\",\"content\":\"Extract the company name, its city and up to 3 keywords.\"},"
                + "{\"role\":\"user\",\"content\":" + quote(text) + "}],"
                + "\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"company\",\"strict\":true,"
                + "\"schema\":" + SCHEMA + "}}}";
        HttpRequest.Builder request = HttpRequest.newBuilder(URI.create(base + "/chat/completions"))
                .timeout(Duration.ofMinutes(5))
                .header("Content-Type", "application/json")
                .POST(HttpRequest.BodyPublishers.ofString(body));
        if (key != null && !key.isEmpty()) {
            request.header("Authorization", "Bearer " + key);
        }
        HttpClient client = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10)).build();
        HttpResponse<String> response = client.send(request.build(), HttpResponse.BodyHandlers.ofString());
        if (response.statusCode() != 200) {
            System.err.println("HTTP " + response.statusCode() + ": " + response.body());
            System.exit(1);
        }
        Map<?, ?> reply = (Map<?, ?>) new Json(response.body()).value();
        Map<?, ?> choice = (Map<?, ?>) ((List<?>) reply.get("choices")).get(0);
        if (!"stop".equals(choice.get("finish_reason"))) {
            System.err.println("the answer was cut (finish_reason " + choice.get("finish_reason") + ")");
            System.exit(1);
        }
        String content = (String) ((Map<?, ?>) choice.get("message")).get("content");
        Map<?, ?> fields = (Map<?, ?>) new Json(content).value();
        List<String> keywords = new ArrayList<>();
        for (Object k : (List<?>) fields.get("keywords")) {
            keywords.add((String) k);
        }
        Company company = new Company((String) fields.get("name"), (String) fields.get("city"), keywords);
        System.out.println("name: " + company.name());
        System.out.println("city: " + company.city());
        System.out.println("keywords: " + String.join(", ", company.keywords()));
    }

    /** A JSON string literal for {@code s}. */
    static String quote(String s) {
        StringBuilder out = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            switch (c) {
                case '"' -> out.append("\\\"");
                case '\\' -> out.append("\\\\");
                case '\n' -> out.append("\\n");
                case '\r' -> out.append("\\r");
                case '\t' -> out.append("\\t");
                default -> {
                    if (c < 0x20) out.append(String.format("\\u%04x", (int) c));
                    else out.append(c);
                }
            }
        }
        return out.append('"').toString();
    }

    /** A small strict JSON parser (RFC 8259): objects to maps, arrays to lists, numbers to doubles. */
    static final class Json {
        private final String s;
        private int i;

        Json(String s) {
            this.s = s;
        }

        Object value() {
            Object v = any();
            ws();
            if (i != s.length()) throw error("trailing characters");
            return v;
        }

        private Object any() {
            ws();
            if (i >= s.length()) throw error("unexpected end");
            char c = s.charAt(i);
            switch (c) {
                case '{': return object();
                case '[': return array();
                case '"': return string();
                case 't': return literal("true", Boolean.TRUE);
                case 'f': return literal("false", Boolean.FALSE);
                case 'n': return literal("null", null);
                default: return number();
            }
        }

        private Map<String, Object> object() {
            Map<String, Object> out = new LinkedHashMap<>();
            i++;
            ws();
            if (peek() == '}') { i++; return out; }
            while (true) {
                ws();
                String k = string();
                ws();
                expect(':');
                out.put(k, any());
                ws();
                if (peek() == ',') { i++; continue; }
                expect('}');
                return out;
            }
        }

        private List<Object> array() {
            List<Object> out = new ArrayList<>();
            i++;
            ws();
            if (peek() == ']') { i++; return out; }
            while (true) {
                out.add(any());
                ws();
                if (peek() == ',') { i++; continue; }
                expect(']');
                return out;
            }
        }

        private String string() {
            expect('"');
            StringBuilder out = new StringBuilder();
            while (true) {
                if (i >= s.length()) throw error("unterminated string");
                char c = s.charAt(i++);
                if (c == '"') return out.toString();
                if (c != '\\') { out.append(c); continue; }
                char e = s.charAt(i++);
                switch (e) {
                    case 'n' -> out.append('\n');
                    case 't' -> out.append('\t');
                    case 'r' -> out.append('\r');
                    case 'b' -> out.append('\b');
                    case 'f' -> out.append('\f');
                    case 'u' -> { out.append((char) Integer.parseInt(s.substring(i, i + 4), 16)); i += 4; }
                    default -> out.append(e);
                }
            }
        }

        private Double number() {
            int start = i;
            while (i < s.length() && "+-0123456789.eE".indexOf(s.charAt(i)) >= 0) i++;
            if (start == i) throw error("unexpected character");
            return Double.parseDouble(s.substring(start, i));
        }

        private Object literal(String word, Object v) {
            if (!s.startsWith(word, i)) throw error("bad literal");
            i += word.length();
            return v;
        }

        private void ws() {
            while (i < s.length() && " \t\r\n".indexOf(s.charAt(i)) >= 0) i++;
        }

        private char peek() {
            return i < s.length() ? s.charAt(i) : '\0';
        }

        private void expect(char c) {
            if (peek() != c) throw error("expected '" + c + "'");
            i++;
        }

        private IllegalArgumentException error(String what) {
            return new IllegalArgumentException("invalid JSON at " + i + ": " + what);
        }
    }
}
