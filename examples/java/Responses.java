// The Responses API (POST /v1/responses) from llamadeploy using only the JDK (java.net.http, Java 17+):
// one streamed request, read as OpenAI's Server-Sent Events ("event: <type>" then "data: <json>"),
// the text deltas shown as they arrive and the final answer taken from response.completed (or
// response.incomplete, when max_output_tokens cut it), as openai-java and LangChain4j do.
// Run:  java Responses.java "What is the capital of France?"
// Env:  LLAMADEPLOY_URL (default http://127.0.0.1:8000/v1), LLAMADEPLOY_MODEL, LLAMADEPLOY_API_KEY (optional).
// Prints the streamed text, then "status: ...", "text: ...", "streamed: ...", "usage: ..." and
// "events: N" lines (newlines in the texts shown as spaces); exits 1 on an HTTP error or a failed response.
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.stream.Stream;

public class Responses {
    public static void main(String[] args) throws Exception {
        String base = System.getenv().getOrDefault("LLAMADEPLOY_URL", "http://127.0.0.1:8000/v1");
        String model = System.getenv().getOrDefault("LLAMADEPLOY_MODEL", "smollm2-135m-instruct");
        String key = System.getenv("LLAMADEPLOY_API_KEY");
        String question = args.length > 0 ? String.join(" ", args) : "What is the capital of France?";

        String body = "{\"model\":" + quote(model) + ",\"stream\":true,\"store\":false,\"temperature\":0,"
                + "\"max_output_tokens\":100,\"instructions\":\"Answer in one sentence.\","
                + "\"input\":[{\"role\":\"user\",\"content\":" + quote(question) + "}]}";
        HttpRequest.Builder request = HttpRequest.newBuilder(URI.create(base + "/responses"))
                .timeout(Duration.ofMinutes(5))
                .header("Content-Type", "application/json")
                .header("Accept", "text/event-stream")
                .POST(HttpRequest.BodyPublishers.ofString(body));
        if (key != null && !key.isEmpty()) {
            request.header("Authorization", "Bearer " + key);
        }
        HttpClient client = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(10)).build();
        HttpResponse<Stream<String>> response = client.send(request.build(), HttpResponse.BodyHandlers.ofLines());
        if (response.statusCode() != 200) {
            System.err.println("HTTP " + response.statusCode() + ": " + String.join("\n", response.body().toList()));
            System.exit(1);
        }
        Reader reader = new Reader();
        response.body().forEach(reader::line);
        System.out.println();
        if (reader.last == null) {
            System.err.println("the stream ended without response.completed or response.incomplete");
            System.exit(1);
        }
        Map<?, ?> usage = (Map<?, ?>) reader.last.get("usage");
        Map<?, ?> details = (Map<?, ?>) usage.get("input_tokens_details");
        System.out.println("status: " + reader.last.get("status"));
        System.out.println("text: " + oneLine(outputText(reader.last)));
        System.out.println("streamed: " + oneLine(reader.streamed.toString()));
        System.out.printf("usage: %d input (%d cached), %d output%n", num(usage.get("input_tokens")),
                num(details.get("cached_tokens")), num(usage.get("output_tokens")));
        System.out.println("events: " + reader.events);
    }

    /** Follows the event stream: the text deltas, and the final response object. */
    static final class Reader {
        String event;
        int events;
        final StringBuilder streamed = new StringBuilder();
        Map<?, ?> last;

        void line(String line) {
            if (line.startsWith("event: ")) {
                event = line.substring(7);
                return;
            }
            if (!line.startsWith("data: ")) {
                return;
            }
            Map<?, ?> data = (Map<?, ?>) new Json(line.substring(6)).value();
            String type = (String) data.get("type");
            if (!type.equals(event) || num(data.get("sequence_number")) != events) {
                throw new IllegalStateException("event " + event + " / type " + type + " out of order");
            }
            events++;
            switch (type) {
                case "response.output_text.delta" -> {
                    String delta = (String) data.get("delta");
                    streamed.append(delta);
                    System.out.print(delta);
                    System.out.flush();
                }
                case "response.completed", "response.incomplete" -> last = (Map<?, ?>) data.get("response");
                case "response.failed", "error" -> {
                    System.err.println("\nfailed: " + data);
                    System.exit(1);
                }
                default -> { }
            }
        }
    }

    /** The text of every output_text part of the response's message items. */
    static String outputText(Map<?, ?> response) {
        StringBuilder out = new StringBuilder();
        for (Object item : (List<?>) response.get("output")) {
            Map<?, ?> m = (Map<?, ?>) item;
            if (!"message".equals(m.get("type"))) continue;
            for (Object part : (List<?>) m.get("content")) {
                Map<?, ?> p = (Map<?, ?>) part;
                if ("output_text".equals(p.get("type"))) out.append((String) p.get("text"));
            }
        }
        return out.toString();
    }

    static String oneLine(String s) {
        return s.replace('\n', ' ').replace('\r', ' ');
    }

    static long num(Object v) {
        return ((Double) v).longValue();
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
